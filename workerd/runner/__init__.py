"""Running one step on this rank: the persistent batch, the KV cache, the model
runner and its CUDA graphs."""
