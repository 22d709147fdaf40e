"""Model building blocks, tensor-parallel aware."""
