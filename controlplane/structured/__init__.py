"""Structured outputs: grammar-constrained decoding, kept beside the scheduler.

As in vLLM V1, the grammar state lives with the scheduler (here, the
controlplane), never on the workers: a request's grammar is checked at the API
edge (validate.py), compiled off the engine thread while the request waits
(backend.py; engine/grammar_gate.py holds it), and its matcher advances on the
real sampled tokens in update_from_output. After each step is scheduled, one
mask per constrained request that samples is filled and sent to the output
rank alone (mask_codec.py encodes it), which applies it before sampling. The
workers need no tokenizer and no xgrammar, and hold no grammar state to lose:
preemption and worker recovery rebuild nothing.
"""
