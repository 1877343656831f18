"""One eager launch of the CUDA layer kernel (bert-base, fuse 2) after a warm-up: a target for a profiler
(e.g. `ncu --kernel-name regex:layer_kernel --launch-skip 3 --launch-count 1 python3 scripts/layer_once.py`)."""

import torch

from tuner.config import DecoderConfig
from tuner.kernels.fused_layer import FusedLayerConfig
from tuner.layer import DecoderStack, fit_config
from tuner.shapes import resolve


def main():
    shape = resolve("bert-base")
    cfg = fit_config(DecoderConfig(layer=FusedLayerConfig(fuse=2, num_stages=10, out_split_k=4, ffn2_split_k=4)),
                     shape)
    st = DecoderStack(shape, cfg, n_layers=2, dtype=torch.float16, device="cuda", seed=0)
    for _ in range(3):
        st.run()
    torch.cuda.synchronize()
    print("rel err", st.check(seed=1))


if __name__ == "__main__":
    main()
