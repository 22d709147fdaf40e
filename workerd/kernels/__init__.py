"""kvloom's C kernels for CPU ranks: the sources, the loader that builds them,
and their Python entry points."""
