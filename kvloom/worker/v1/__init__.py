"""Generated stubs of protos/kvloom/worker/v1 (scripts/gen_protos.sh)."""
