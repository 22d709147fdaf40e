"""Generated stubs of protos/kvloom/kvtransfer/v1 (scripts/gen_protos.sh)."""
