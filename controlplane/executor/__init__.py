"""The worker plane: the executor that drives the worker group over gRPC
streams (the StepExecutor interface the engine steps through), its start-up
handshake, pending calls, reply checks and protobuf conversion."""
