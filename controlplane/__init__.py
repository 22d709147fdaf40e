"""kvloom controlplane: client API, scheduler, logical KV blocks, and the worker executor."""
