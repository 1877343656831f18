"""GPU check of the Triton kernels' shared-memory counts (fused_layer.smem_bytes, gemm.smem_bytes).

layer (default): for every one-kernel-layer launch that a committed study's GPU refused for shared memory
(results/*/*/trials.csv, status out_of_resources), fit the sampled configuration as the evaluator does now, run a
2-layer stack of it in a CUDA graph, check it against the reference, and print the count beside the compiled kernel's.
gemm: tests/test_gemm.py's compile cases (and two deeper mma.sync configs that the count before session 21 refused)
launched by linear() on bert-base's GEMMs: the count beside the compiled kernel's, the output against the same launch
with the default tiles.
usage: python scripts/smem_check.py [layer|gemm]
"""

import csv
from pathlib import Path

from tuner.config import DecoderConfig
from tuner.device import DeviceInfo
from tuner.kernels import fused_layer as fk
from tuner.layer import DecoderStack, layer_problem
from tuner.shapes import resolve


def compiled_kernels(fn) -> dict[int, object]:
    """Every compiled variant of the Triton kernel ``fn`` in this process, by identity (none in the interpreter)."""
    return {id(k): k for cache in getattr(fn, "device_caches", {}).values() for k in cache[0].values()}


def new_shared(fn, before: dict[int, object]) -> list[int]:
    """metadata.shared of the variants of ``fn`` compiled since ``before`` (a :func:`compiled_kernels`)."""
    return sorted(k.metadata.shared for i, k in compiled_kernels(fn).items() if i not in before)


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
        before = compiled_kernels(fk._layer_kernel)
        st = DecoderStack(shape, DecoderConfig(layer=cfg), n_layers=2)
        st.capture()
        err = st.check(seed=1)
        new = new_shared(fk._layer_kernel, before)
        print(f"{name}: refused at {need} B with {sampled.num_stages} stages; fitted {cfg.num_stages} stages, "
              f"count {fk.smem_bytes(cfg, p, dev)} B, compiled {new or 'as above (same kernel)'} B, check() "
              f"{fk.check(cfg, p, dev) or 'ok'}, rel. error {err:.2e} (tolerance {st.tolerance():g})")


def gemm_main() -> None:
    import sys

    import torch

    from tuner.kernels import gemm

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from test_gemm import BERT_GEMMS, SMEM_CASES

    on = "cuda" if torch.cuda.is_available() else "cpu"  # (cpu: TRITON_INTERPRET=1, a dry run: nothing is compiled)
    dev = DeviceInfo.from_torch() if on == "cuda" else DeviceInfo.interpreter()
    cases = dict(SMEM_CASES)
    cases["mma.sync, 6 stages"] = ("ffn1", gemm.GemmConfig(block_m=32, block_n=128, block_k=128, num_stages=6))
    cases["mma.sync-tma, 6 stages"] = ("ffn2", gemm.GemmConfig(block_m=32, block_n=128, block_k=128, num_stages=6,
                                                               tma=1))
    g = torch.Generator(device=on).manual_seed(0)
    print(f"{dev.name}: {len(cases)} GEMM configurations (limit {dev.smem_per_block_bytes} B)")
    r = lambda *shape: torch.randn(shape, generator=g, device=on).half()  # noqa: E731
    for name, (which, c) in cases.items():
        p, launch = BERT_GEMMS[which]
        x, w = r(p.m, p.k), 0.05 * r(p.n, p.k)
        kw = dict(bias=r(p.n) if launch.get("bias") else None, activation=launch.get("activation"),
                  residual=r(p.m, p.n) if launch.get("residual") else None)
        if launch.get("ln"):
            kw["ln_colsum"] = w.float().sum(1)
            if launch["ln"] == 2:  # a producer's row sums of x over p.ln_parts column parts
                xp = x.float().view(p.m, p.ln_parts, -1)
                kw["ln_stats"] = torch.stack((xp.sum(2), (xp * xp).sum(2)), -1).transpose(0, 1).contiguous()
        stats = lambda cfg: (dict(stats_out=torch.zeros(gemm.stats_parts(cfg, p.n), p.m, 2, device=on))  # noqa: E731
                             if launch.get("stats_out") else {})
        why = gemm.check(c, p, dev)
        count = gemm.smem_bytes(c, p.dtype_bytes, dev, p.ln_parts)
        if why:
            print(f"{name} ({which}): count {count} B, check() refuses: {why}")
            continue
        before = compiled_kernels(gemm._gemm_kernel)
        y = gemm.linear(x, w, config=c, **kw, **stats(c))  # (compiled at the launch, before it runs)
        new = new_shared(gemm._gemm_kernel, before)
        ref = gemm.linear(x, w, config=gemm.GemmConfig(), **kw, **stats(gemm.GemmConfig()))
        err = float((y.double() - ref.double()).norm() / ref.double().norm())
        print(f"{name} ({which}): count {count} B, compiled {new} B, rel. difference from the default tiles' {err:.1e}")


if __name__ == "__main__":
    import sys

    from tuner.device import require_gpu

    require_gpu(__file__, dry_run_ok=sys.argv[1:] == ["gemm"])
    gemm_main() if sys.argv[1:] == ["gemm"] else main()
