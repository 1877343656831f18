"""Triton kernels of a transformer layer, each beside its torch reference.

Installed as ``tuner.kernels`` (the folder is ``kernels/`` in the checkout). Every launcher takes a
frozen config dataclass, switches PDL and L2 prefetch off by itself where the device cannot do them
(pre-Hopper GPUs, the Triton interpreter), and reports the effective config.
"""
