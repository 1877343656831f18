"""pdl-tune: search-based tuning of Triton transformer-layer kernels with PDL and L2 prefetch."""

__version__ = "0.1.0"


def load_config(path, **kw):
    """Load an exported best.json (see tuner.export.load_config)."""
    from tuner.export import load_config as _load

    return _load(path, **kw)
