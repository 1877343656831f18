"""The layer's kernel names, and which launches read a GEMM's L2 hints: plain values only, so that tuner.report
(which must open a run folder on a laptop with neither torch nor triton) and tuner.config / tuner.layer share one
copy."""

from __future__ import annotations

# Launch order inside one layer (pre-LN decoder), and its four GEMMs.
KERNELS = ("norm1", "qkv", "attn", "out", "norm2", "ffn1", "ffn2")
GEMMS = ("qkv", "out", "ffn1", "ffn2")


def reads_l2_hints(gemm: str, cluster, fuse, ffn2_fuse) -> bool:
    """Whether the launch that runs GEMM ``gemm`` reads its ``hints`` field (gemm.GemmConfig.hints): only the CUDA
    kernels do. Those are the cluster GEMM (``cluster`` 1 or 2), QKV's kernel with the attention (``qkv.fuse`` 1)
    and, for FFN1, the one-kernel feed-forward block (``ffn2.fuse`` 1 or 2). The Triton kernels ignore it.
    Arguments are the GEMM's ``cluster`` and ``fuse`` and FFN2's ``fuse``, as ints or as a run file holds them."""
    return cluster in (1, 2) or (gemm == "qkv" and fuse == 1) or (gemm == "ffn1" and ffn2_fuse in (1, 2))
