"""The controlplane <-> workerd protocol (internal; not part of the client API)."""
