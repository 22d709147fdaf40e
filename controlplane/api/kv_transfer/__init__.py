"""Prefill/decode disaggregation at the API edge (issue 44): the transfer
parameters of vLLM's NixlConnector (params.py), the producer's KVTransfer
service (service.py) and the consumer's client of it (producers.py)."""
