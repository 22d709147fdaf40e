"""Attention over the paged KV cache: the backend interface, its metadata and the three backends."""
