"""`tune`: the command line. ``main(argv) -> int``; user mistakes get one line and exit code 2."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

EXIT_USAGE = 2


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit code 2, no traceback."""


def _shapes(values: list[str] | None, shape_file: str | None = None):
    from tuner.shapes import PRESETS, ShapeError, resolve

    names = values or ["bert-base"]
    out = []
    try:
        for v in names:
            out.extend(PRESETS.values() if v.strip().lower() == "all" else [resolve(v)])
        if shape_file:
            out.extend(_read_shape_file(shape_file))
    except ShapeError as e:
        raise UserError(str(e)) from None
    return out


def _read_shape_file(path: str):
    import yaml

    from tuner.shapes import DecoderShape, ShapeError

    p = Path(path)
    if not p.is_file():
        raise UserError(f"--shape-file {path}: no such file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"--shape-file {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    items = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise UserError(f"--shape-file {path}: expected a list of shapes under 'shapes'")
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise UserError(f"--shape-file {path}: shapes[{i}] must be a mapping with batch, seq, d_model, heads, ffn")
        try:
            out.append(DecoderShape(**it))
        except TypeError as e:
            raise UserError(f"--shape-file {path}: shapes[{i}]: {e}") from None
        except ShapeError as e:
            raise UserError(f"--shape-file {path}: shapes[{i}]: {e}") from None
    return out


def _dtype(name: str):
    from tuner.layer import DTYPES

    if name not in DTYPES:
        raise UserError(f"--dtype {name}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _need_gpu(what: str):
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{what} needs a CUDA GPU and none is visible; without one, use `tune decoder --replay FILE`")


def cmd_shapes(args) -> int:
    from tuner.shapes import PRESETS

    print(f"{'name':<12} {'BxSxDxHxF':<22} {'head_dim':>8} {'weights/layer (fp16)':>22}")
    for name, s in PRESETS.items():
        print(f"{name:<12} {s.spec:<22} {s.head_dim:>8} {s.weight_bytes(2) / 1e6:>19.1f} MB")
    print("custom: --shape BxSxDxHxF (e.g. 1x128x768x12x3072) or --shape-file FILE.yaml")
    return 0


def cmd_bench(args) -> int:
    from tuner import bench

    shapes = _shapes(args.shape, args.shape_file)
    dtype = _dtype(args.dtype)
    _need_gpu("tune bench")
    extra = {}
    if args.config:
        from tuner.export import load_config

        cfg = load_config(args.config, strict=False)
        extra[f"ours, {args.config}"] = cfg
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for shape in shapes:
        print(f"bench {shape.label} ...", flush=True)
        res = bench.run_bench(shape, dtype=dtype, l2=args.l2, reps=args.reps, seed=args.seed, extra_configs=extra,
                              compile_baseline=not args.no_compile)
        out = bench.save(res, Path(args.out) / "bench" / shape.label / stamp, ["tune"] + (args.argv or []))
        print(bench.format_table(res))
        print(f"written to {out}")
    return 0


def cmd_verify(args) -> int:
    import json

    from tuner import bench, manifest, verify

    shapes = _shapes(args.shape)
    dtype = _dtype(args.dtype)
    _need_gpu("tune verify")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for shape in shapes:
        res = verify.run_verify(shape, bench.hand_picked(shape), dtype=dtype, race_trials=args.trials)
        out = Path(args.out) / "verify" / shape.label / stamp
        manifest.write_json_atomic(out / "manifest.json", manifest.make(["tune"] + args.argv, kind="verify",
                                                                         shape=shape.to_dict()))
        manifest.write_json_atomic(out / "verify.json", res)
        print(json.dumps(res, indent=1))
        print(f"written to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tune", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("shapes", help="list the shape presets")
    s.set_defaults(func=cmd_shapes)

    b = sub.add_parser("bench", help="our layer against torch eager, torch.compile and the memory floor")
    b.add_argument("--shape", action="append", help="preset, BxSxDxHxF or 'all' (repeatable)")
    b.add_argument("--shape-file")
    b.add_argument("--dtype", default="float16")
    b.add_argument("--l2", choices=["cold", "hot"], default="cold")
    b.add_argument("--reps", type=int, default=50)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--config", help="a best.json to measure beside the baselines")
    b.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    b.add_argument("--out", default="results")
    b.set_defaults(func=cmd_bench)

    v = sub.add_parser("verify", help="show the PDL chain (launch census, graph edges) and that the gate catches races")
    v.add_argument("--shape", action="append")
    v.add_argument("--dtype", default="float16")
    v.add_argument("--trials", type=int, default=20)
    v.add_argument("--out", default="results")
    v.set_defaults(func=cmd_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed its one-line usage error
        return int(e.code or 0)
    args.argv = argv
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tune: interrupted; completed trials are kept in the study storage", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
