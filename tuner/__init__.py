"""pdl-tune: search-based tuning of Triton transformer-layer kernels with PDL and L2 prefetch."""

__version__ = "0.1.0"
