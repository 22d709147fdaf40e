"""The vllm.grpc.engine.VllmEngine service (the SMG gateway's engine protocol)."""
