"""Harnesses that join both daemons in one process, and the tiny checkpoints
they run: shared by tests and benchmarks, on the floor above the daemons
(kvloom/__init__.py has the house), so never imported by them.
Needs the server extra (torch, transformers)."""
