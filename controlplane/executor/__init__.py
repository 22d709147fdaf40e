"""The worker plane: the executor that drives the worker group over gRPC
streams, its start-up handshake, pending calls and protobuf conversion."""
