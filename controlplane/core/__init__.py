"""Scheduling core: requests, block pool, KV cache manager, scheduler. No torch, no grpc."""
