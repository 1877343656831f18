"""GPU check of the one-kernel layer's shared-memory count (kernels/fused_layer.smem_bytes).

For every one-kernel-layer launch that a committed study's GPU refused for shared memory (results/*/*/trials.csv,
status out_of_resources), fit the sampled configuration as the evaluator does now, run a 2-layer stack of it in a
CUDA graph, check it against the reference, and print the count beside the compiled kernel's own.
usage: python scripts/smem_check.py
"""

import csv
from pathlib import Path

from tuner.config import DecoderConfig
from tuner.device import DeviceInfo
from tuner.kernels import fused_layer as fk
from tuner.layer import DecoderStack, layer_problem
from tuner.shapes import resolve


def compiled_shared() -> list[int]:
    """metadata.shared of every compiled variant of the kernel in this process."""
    out = []
    for cache in fk._layer_kernel.device_caches.values():
        for k in cache[0].values():
            out.append(k.metadata.shared)
    return out


def refused_layer_configs() -> dict[tuple[str, int], fk.FusedLayerConfig]:
    """The one-kernel-layer configurations, as sampled, whose launch a committed study's GPU refused for shared memory
    (results/<shape>/<run>/trials.csv, status out_of_resources): the first of each (shape name, the GPU's "Required"
    bytes). tests/test_fused_layer.py replays them too."""
    seen = {}
    for f in sorted(Path(__file__).parents[1].glob("results/*/*/trials.csv")):
        for row in csv.DictReader(f.open()):
            if row["status"] == "out_of_resources" and row.get("layer.fuse") == "1":
                sampled = fk.FusedLayerConfig.from_dict({k[6:]: v for k, v in row.items() if k.startswith("layer.")})
                seen.setdefault((f.parts[-3], int(row["reason"].split("Required: ")[1].split(",")[0])), sampled)
    return seen


def main() -> None:
    dev = DeviceInfo.from_torch()
    seen = refused_layer_configs()
    print(f"{dev.name}: {len(seen)} refused configurations")
    for (name, need), sampled in seen.items():
        shape = resolve(name)
        p = layer_problem(shape)
        cfg = fk.fit(sampled, p)
        before = set(compiled_shared())
        st = DecoderStack(shape, DecoderConfig(layer=cfg), n_layers=2)
        st.capture()
        err = st.check(seed=1)
        new = sorted(set(compiled_shared()) - before)
        print(f"{name}: refused at {need} B with {sampled.num_stages} stages; fitted {cfg.num_stages} stages, "
              f"count {fk.smem_bytes(cfg, p, dev)} B, compiled {new or 'as above (same kernel)'} B, check() "
              f"{fk.check(cfg, p, dev) or 'ok'}, rel. error {err:.2e} (tolerance {st.tolerance():g})")


if __name__ == "__main__":
    main()
