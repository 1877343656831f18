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


def _check_storage(url: str | None, out_root: Path) -> str:
    import optuna

    if url is None:
        out_root.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(out_root / 'studies.db').as_posix()}"
    if "://" not in url:
        raise UserError(f"--storage {url!r}: expected a URL like sqlite:///results/studies.db, "
                        "postgresql://user@host/db, or journal:PATH for a journal file")
    try:
        optuna.storages.get_storage(_storage_obj(url))
    except Exception as e:  # noqa: BLE001 - any failure here is the user's URL or server
        first = " ".join(str(e).split())[:200]
        raise UserError(f"--storage {url!r}: cannot open it ({type(e).__name__}: {first})") from None
    return url


def _storage_obj(url: str):
    if url.startswith("journal:"):
        import optuna.storages.journal as j

        return optuna.storages.JournalStorage(j.JournalFileBackend(url[len("journal:"):]))
    return url


def cmd_decoder(args) -> int:
    from tuner import space as space_mod
    from tuner.evaluate import GpuEvaluator, ReplayEvaluator
    from tuner.study import SAMPLERS, StudyError, StudyOptions, run_study

    shapes = _shapes(args.shape, args.shape_file)
    _dtype(args.dtype)
    if args.trials is not None and args.trials <= 0:
        raise UserError(f"--trials {args.trials}: must be a positive number of trials")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout {args.timeout}: must be a positive number of seconds")
    if args.top_k <= 0:
        raise UserError(f"--top-k {args.top_k}: must be positive")
    if args.sampler not in SAMPLERS:
        raise UserError(f"--sampler {args.sampler}: choose one of {', '.join(SAMPLERS)}")
    try:
        space = space_mod.load(args.search_space)
    except space_mod.SpaceError as e:
        raise UserError(str(e)) from None
    if args.replay and len(shapes) > 1:
        raise UserError("--replay serves one recording, i.e. one shape: give one --shape")
    if args.replay and not Path(args.replay).exists():
        raise UserError(f"--replay {args.replay}: no such file or folder")
    if not args.replay:
        _need_gpu("tune decoder")
    out_root = Path(args.out)
    storage = _check_storage(args.storage, out_root)
    opts = StudyOptions(trials=args.trials or 120, timeout_s=args.timeout, sampler=args.sampler, seed=args.seed,
                        storage=_storage_obj(storage) if storage.startswith("journal:") else storage,
                        study_name=args.study_name, top_k=args.top_k, dtype=args.dtype, l2=args.l2,
                        progress=not args.no_progress)
    runs = []
    for shape in shapes:
        try:
            if args.replay:
                ev = ReplayEvaluator(args.replay, shape if args.shape else None)
                shape = ev.shape
                print(f"REPLAYING {args.replay}: timings recorded on {ev.device_name}, nothing is measured now")
            else:
                ev = GpuEvaluator(shape, dtype=args.dtype, l2=args.l2, seed=args.seed)
            run = run_study(shape, ev, space, opts, out_root, ["tune"] + args.argv)
        except (StudyError, ValueError, FileNotFoundError) as e:
            raise UserError(str(e).splitlines()[0]) from None
        runs.append(run)
        print((run / "topk.md").read_text())
        print(f"run folder: {run}")
    if len(runs) > 1:
        from tuner import report

        path = out_root / f"summary-{time.strftime('%Y%m%d-%H%M%S')}.md"
        report.write_summary([report.load_run(r) for r in runs], path)
        print(path.read_text())
        print(f"summary: {path}")
    return 0


def _run_dir(path: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{path}: not a run folder (expected results/<shape>/<run-id>/)")
    return p


def cmd_report(args) -> int:
    from tuner import report

    run = _run_dir(args.run)
    try:
        written = report.write_reports(run)
    except report.RunFolderError as e:
        raise UserError(str(e)) from None
    print((run / "topk.md").read_text())
    for w in written:
        print(f"written {w}")
    return 0


def cmd_export(args) -> int:
    import json

    from tuner.config import ConfigError
    from tuner.export import read_best
    from tuner.manifest import write_json_atomic

    run = _run_dir(args.run)
    try:
        best = read_best(run)
    except ConfigError as e:
        raise UserError(str(e)) from None
    if args.output:
        write_json_atomic(Path(args.output), best)
        print(f"written {args.output}")
    else:
        print(json.dumps(best, indent=2))
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

    d = sub.add_parser("decoder", help="tune a decoder layer (Optuna study on the GPU, or --replay)")
    d.add_argument("--shape", action="append", help="preset, BxSxDxHxF or 'all' (repeatable); default bert-base")
    d.add_argument("--shape-file", help="YAML list of shapes (batch, seq, d_model, heads, ffn)")
    d.add_argument("--trials", type=int, default=None, help="the study's total trial budget (default 120)")
    d.add_argument("--timeout", type=float, default=420.0, help="seconds of search per shape (default 420)")
    d.add_argument("--sampler", default="tpe", help="tpe|random|grid|cmaes|gp|qmc")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--storage", help="Optuna storage URL (default sqlite:///<out>/studies.db); journal:PATH too")
    d.add_argument("--study-name")
    d.add_argument("--top-k", type=int, default=10)
    d.add_argument("--dtype", default="float16")
    d.add_argument("--l2", choices=["cold", "hot"], default="cold")
    d.add_argument("--out", default="results")
    d.add_argument("--search-space", help="a YAML search space (default: the shipped decoder.yaml)")
    d.add_argument("--replay", help="serve timings from a recorded run folder or trials.csv (no GPU needed)")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(func=cmd_decoder)

    r = sub.add_parser("report", help="re-draw tables and plots of a run folder")
    r.add_argument("run")
    r.set_defaults(func=cmd_report)

    e = sub.add_parser("export", help="the best configuration of a run as JSON")
    e.add_argument("run")
    e.add_argument("-o", "--output")
    e.set_defaults(func=cmd_export)

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
