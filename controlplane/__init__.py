"""kvloom controlplane: client API, scheduler, logical KV blocks, and the executor that drives workers."""
