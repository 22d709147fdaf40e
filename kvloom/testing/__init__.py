"""Harnesses that join both daemons in one process, and the tiny checkpoints
they run: shared by tests and benchmarks (never imported by the daemons).
Needs the server extra (torch, transformers)."""
