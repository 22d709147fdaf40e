"""EngineCore: the controlplane's busy loop, pipelined steps, pacing and worker-group recovery."""
