"""Generated stubs of protos/kvloom/v1, the public client API (scripts/gen_protos.sh)."""
