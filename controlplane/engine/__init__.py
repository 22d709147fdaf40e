"""EngineCore (core.py): the controlplane's busy loop and its step; the steps
in flight (step_queue.py) and their pacing (step_pacing.py); holding requests
while the worker group re-forms (recovery.py); internal errors (failures.py)."""
