"""The layer's kernel names, which launches read a GEMM's L2 hints, and which kernels run a GEMM: plain values only,
so that tuner.report (which must open a run folder on a laptop with neither torch nor triton) and tuner.config /
tuner.layer share one copy."""

from __future__ import annotations

# Launch order inside one layer (pre-LN decoder), and its four GEMMs.
KERNELS = ("norm1", "qkv", "attn", "out", "norm2", "ffn1", "ffn2")
GEMMS = ("qkv", "out", "ffn1", "ffn2")
# The most row-sum parts of its producer that a CUDA GEMM folding a LayerNorm reads (MAX_LN_PARTS of cluster_gemm.cu,
# qkv_attn.cu and mlp_cluster.cu; tests/test_report.py reads them there).
MAX_LN_PARTS = 32


def reads_l2_hints(gemm: str, cluster, fuse, ffn2_fuse) -> bool:
    """Whether the launch that runs GEMM ``gemm`` reads its ``hints`` field (gemm.GemmConfig.hints): only the CUDA
    kernels do. Those are the cluster GEMM (``cluster`` 1 or 2), QKV's kernel with the attention (``qkv.fuse`` 1)
    and, for FFN1, the one-kernel feed-forward block (``ffn2.fuse`` 1 or 2). The Triton kernels ignore it.
    Arguments are the GEMM's ``cluster`` and ``fuse`` and FFN2's ``fuse``, as ints or as a run file holds them."""
    return cluster in (1, 2) or (gemm == "qkv" and fuse == 1) or (gemm == "ffn1" and ffn2_fuse in (1, 2))


def gemm_kernels(gemm: str, cluster, fuse, ffn2_fuse, norm_fuse, parts=None) -> tuple[str, ...]:
    """The kernels that run GEMM ``gemm`` in the stack's layers, as gemm.linear decides at its launch: ``("triton",)``,
    ``("cluster",)`` or both (where layers differ, or where ``parts`` is None and so not judged); ``()`` for a GEMM
    computed in another kernel's launch (QKV with the attention: ``fuse`` 1; the out-projection or FFN2 inside the
    one-kernel feed-forward block: their ``fuse``; FFN1 as that block: ``ffn2_fuse``).

    An unclustered GEMM (``cluster`` 0) runs on the Triton kernels, a clustered one that folds no LayerNorm on the
    cluster kernel. One that folds it (``norm_fuse``: QKV's is norm1's, FFN1's norm2's) runs on the Triton kernels
    where its row sums come from its K loop (1), and where they come from its producer (2) on the cluster kernel if
    that reads all their ``parts`` (at most MAX_LN_PARTS), else on the Triton kernels. QKV's producer is the previous
    layer's FFN2: the stack's first layer has no row sums, and runs QKV on the Triton kernels. Arguments as ints or as
    a run file holds them."""
    if fuse or (gemm == "ffn1" and ffn2_fuse):
        return ()
    if not cluster:
        return ("triton",)
    if gemm not in ("qkv", "ffn1") or not norm_fuse:
        return ("cluster",)
    if norm_fuse == 1:
        return ("triton",)
    if parts is None:
        return ("triton", "cluster")
    if parts > MAX_LN_PARTS:
        return ("triton",)
    return ("triton", "cluster") if gemm == "qkv" else ("cluster",)
