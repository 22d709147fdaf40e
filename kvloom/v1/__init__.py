"""Generated protobuf and gRPC stubs of protos/kvloom/v1 (scripts/gen_protos.sh)."""
