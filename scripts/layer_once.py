"""A few eager launches of a bert-base layer stack after a warm-up: a target for a profiler.

usage: python3 scripts/layer_once.py [CONFIG]   (CONFIG: a best.json or a timeline.py variant; default: the CUDA layer
kernel, fuse 2)
e.g. `ncu --kernel-name regex:layer_kernel --launch-skip 3 --launch-count 1 python3 scripts/layer_once.py`, or for the
cluster GEMM `ncu --kernel-name-base demangled --kernel-name "regex:cluster_gemm_kernel<.bool.0, .int.1," ...
python3 scripts/layer_once.py best.json:qkv.cluster=1`."""

import os
import sys

import torch

from tuner.config import DecoderConfig
from tuner.kernels.fused_layer import FusedLayerConfig
from tuner.layer import DecoderStack, fit_config
from tuner.shapes import resolve


def main():
    shape = resolve("bert-base")
    if len(sys.argv) > 1:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from timeline import variant

        cfg = variant(shape, sys.argv[1])
    else:
        cfg = fit_config(DecoderConfig(layer=FusedLayerConfig(fuse=2, num_stages=10, out_split_k=4, ffn2_split_k=4)),
                         shape)
    st = DecoderStack(shape, cfg, n_layers=2, dtype=torch.float16, device="cuda", seed=0)
    for _ in range(3):
        st.run()
    torch.cuda.synchronize()
    print("rel err", st.check(seed=1))


if __name__ == "__main__":
    from tuner.device import require_gpu

    require_gpu(__file__)
    main()
