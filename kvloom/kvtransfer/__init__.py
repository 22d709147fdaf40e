"""Controlplane <-> controlplane KV transfer (prefill/decode disaggregation);
not part of the client API."""
