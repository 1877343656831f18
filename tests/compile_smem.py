"""Shared memory that Triton allocates for the one-kernel layer, compiled for a GPU architecture without a GPU.

Run as a script in a process without TRITON_INTERPRET (tests/test_fused_layer.py does): reads a JSON list of
[FusedLayerConfig fields, [tokens, seq, d_model, heads, ffn], compute capability as an int (90: sm_90)] from stdin
and prints the list of ``metadata.shared`` byte counts. The arguments are specialised as the launcher's are on the
GPU (pointers and the dimensions 16-byte divisible, one sequence): without that the K loops' loads are not pipelined
and the count is far below the GPU's.
"""

import json
import os
import sys

assert not os.environ.get("TRITON_INTERPRET"), "compile_smem.py compiles for a GPU: run it without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from tuner.kernels import fused_layer as fl  # noqa: E402
from tuner.kernels.attention import block_d  # noqa: E402

FP32_PTRS = {"bqkv_ptr", "uqkv_ptr", "bout_ptr", "b1_ptr", "u1_ptr", "b2_ptr", "ws_ptr"}
INT_PTRS = {"sync_ptr", "times_ptr"}


def shared(c: fl.FusedLayerConfig, p: fl.LayerProblem, arch: int = 90, nprog: int = 132) -> int:
    fn = fl._layer_kernel
    names = fn.arg_names
    const = dict(NPROG=nprog, BM=c.block_m, BK=c.block_k, STAGES=c.num_stages, BN_QKV=c.qkv_block_n,
                 SK_QKV=c.qkv_split_k, BN_OUT=c.out_block_n, SK_OUT=c.out_split_k, BN_F1=c.ffn1_block_n,
                 SK_F1=c.ffn1_split_k, BN_F2=c.ffn2_block_n, SK_F2=c.ffn2_split_k, ABM=c.attn_block_m,
                 ABN=c.attn_block_n, BLOCK_D=block_d(p.head_dim), USE_PDL=arch >= 90, PREFETCH=arch >= 90,
                 UPCAST=False, LINE_ELEMS=64, TIMES=False, GELU=1, n_batch=p.tokens // p.seq)
    sig, div = {}, []
    for i, n in enumerate(names):
        if n in const:
            sig[n] = "constexpr"
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n in FP32_PTRS else "*i32" if n in INT_PTRS else "*fp16"
            div.append(i)
        elif n in ("qk_scale", "eps"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if n in ("M", "D", "F", "seq", "head_dim"):
                div.append(i)
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=c.num_warps, num_stages=1))
    return k.metadata.shared


if __name__ == "__main__":
    cases = json.load(sys.stdin)
    print(json.dumps([shared(fl.FusedLayerConfig(**kw), fl.LayerProblem(*dims), arch) for kw, dims, arch in cases]))
