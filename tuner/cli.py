"""`tune`: the command line. ``main(argv) -> int``; user mistakes get one line and exit code 2."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from tuner.manifest import why as _why

EXIT_USAGE = 2
EXIT_FAILED = 1
DEFAULT_TRIALS = 120
DEFAULT_TIMEOUT_S = 120.0  # seconds of search a shape where neither --trials nor --timeout is given
MAX_STUDY_NAME = 512  # characters: optuna.storages._rdb.models.MAX_INDEXED_STRING_LENGTH


class UserError(Exception):
    """A mistake of the user's: printed as one line, exit code 2, no traceback."""


class RunError(Exception):
    """A run that could not go on (e.g. the evaluator worker does not start): one line, exit code 1."""


def _shapes(values: list[str] | None, shape_file: str | None = None):
    from tuner.shapes import PRESETS, ShapeError, resolve

    names = values or ([] if shape_file else ["bert-base"])  # a --shape-file alone: its shapes only
    out = []
    try:
        for v in names:
            out.extend(PRESETS.values() if v.strip().lower() == "all" else [resolve(v, also=("all",))])
        if shape_file:
            out.extend(_read_shape_file(shape_file))
    except ShapeError as e:
        raise UserError(str(e)) from None
    return out


def _read_shape_file(path: str):
    from tuner.shapes import PRESETS, DecoderShape, ShapeError, keys_error
    from tuner.space import read_yaml

    data = read_yaml(path, "shape", UserError)
    items = data.get("shapes") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise UserError(f"--shape-file {path}: expected a list of shapes under 'shapes'"
                        + (", and it is empty" if isinstance(items, list) else ""))
    out = []
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise UserError(f"--shape-file {path}: shapes[{i}] must be a mapping with batch, seq, d_model, heads, ffn")
        why = keys_error(it)
        if why:
            raise UserError(f"--shape-file {path}: shapes[{i}]: {why}")
        try:
            shape = DecoderShape(**it)
        except ShapeError as e:
            raise UserError(f"--shape-file {path}: shapes[{i}]: {e}") from None
        preset = PRESETS.get(shape.name.lower())
        if preset is not None and preset.spec != shape.spec:  # its runs would sit among the preset's (<out>/<name>/)
            raise UserError(f"--shape-file {path}: shapes[{i}]: name {shape.name!r} is the preset {preset.spec}'s, "
                            f"not {shape.spec}'s; give it another name")
        out.append(shape)
    return out


def _dtype(name: str):
    from tuner.layer import DTYPES

    if name not in DTYPES:
        raise UserError(f"--dtype {name}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


# The recordings shipped in the package (tests/data/replay-*, installed as tuner.recordings), by name. The run of
# record's three presets (session 43, H200) are replay-<shape>-h200-20261128; replay-bert-base-h200 is the first
# recording (session 1's kernels, 120 trials), which the tests replay.
RECORD_REPLAY = "replay-bert-base-h200-20261128"


def _recordings() -> dict:
    """The recordings the package ships, by name (none where an install left them out: every command's help names
    them, so their absence must not stop the command line)."""
    import importlib.resources

    try:
        shipped = importlib.resources.files("tuner.recordings")
        return {p.name: p for p in shipped.iterdir() if p.is_dir() and p.name.startswith("replay-")}
    except (ImportError, OSError):
        return {}


def shipped_recordings() -> list[str]:
    """The names of the recordings the package ships (:func:`_recordings`)."""
    return sorted(_recordings())


def _need_gpu(what: str):
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"{what} needs a CUDA GPU and none is visible; without one, `tune decoder --replay "
                        f"{RECORD_REPLAY}` replays the H200 run of record shipped with the package (its tiny and "
                        "bert-large runs too, or give a run folder)")


def cmd_shapes(args) -> int:
    from tuner.shapes import PRESETS

    print(f"{'name':<12} {'BxSxDxHxF':<22} {'head_dim':>8} {'weights/layer (fp16)':>22}")
    for name, s in PRESETS.items():
        print(f"{name:<12} {s.spec:<22} {s.head_dim:>8} {s.weight_bytes(2) / 1e6:>19.1f} MB")
    print("custom: --shape BxSxDxHxF (e.g. 1x128x768x12x3072) or --shape-file FILE.yaml")
    return 0


def _read_best(path: str) -> dict:
    """A best.json (or run folder) for `tune bench --config`, read once: its shape, dtype and config come from it."""
    from tuner.config import ConfigError
    from tuner.export import read_best

    try:
        return read_best(path)
    except ConfigError as e:
        raise UserError(f"--config {e}") from None


def _config_shape(best: dict, path: str):
    """The shape a best.json was tuned for (what `tune bench --config` measures when no --shape is given)."""
    from tuner.shapes import DecoderShape

    try:
        return [DecoderShape.from_dict(best["shape"])]
    except (KeyError, TypeError, ValueError):
        raise UserError(f"--config {path}: best.json has no valid 'shape'; give --shape") from None


def _config_dtype(best: dict, path: str) -> str | None:
    """The dtype a best.json was tuned in (what `tune bench --config` measures when no --dtype is given): its own
    field, else its run's manifest's; None where neither names one."""
    name = best.get("dtype")
    if name is None:  # (a hand-edited best.json)
        name = _run_manifest(Path(path) if Path(path).is_dir() else Path(path).parent).get("dtype")
    return name if isinstance(name, str) else None


def cmd_bench(args) -> int:
    from tuner import bench

    _no_blanks(args, ("shape_file", "config"))
    best = _read_best(args.config) if args.config else None
    if best is not None and not args.shape and not args.shape_file:
        shapes = _config_shape(best, args.config)  # a config is measured on the shape it was tuned for
    else:
        shapes = _shapes(args.shape, args.shape_file)
    tuned = _config_dtype(best, args.config) if best is not None else None
    if args.dtype is None:  # a config is measured in the dtype it was tuned in
        args.dtype = tuned or "float16"
    elif tuned and args.dtype != tuned:  # its timings would not transfer, as for another shape or GPU
        raise UserError(f"--config {args.config}: tuned in {tuned}, not --dtype {args.dtype} (its timings do not "
                        f"transfer); leave --dtype out to measure it in {tuned}")
    dtype = _dtype(args.dtype)
    if args.reps <= 0:
        raise UserError(f"--reps {args.reps}: must be a positive number of repetitions")
    _check_seed(args.seed)
    _check_writable(_folder(args.out, "--out", "give a folder for the results (default results)"), "--out",
                    "cannot write its results there")
    if best is not None:  # schema and shape first: those mistakes are found without a GPU
        for shape in shapes:
            _bench_config(best, args.config, shape=shape, gpu="")
    _need_gpu("tune bench")
    _check_fits(args.l2, shapes, dtype, None)
    extra = {}
    if best is not None:
        extra[f"ours, {args.config}"] = _bench_config(best, args.config, gpu=None)  # None: this GPU's name
    from triton.errors import TritonError

    stamp = time.strftime("%Y%m%d-%H%M%S")
    for shape in shapes:
        print(f"bench {shape.label} ...", flush=True)
        try:
            res = bench.run_bench(shape, dtype=dtype, l2=args.l2, reps=args.reps, seed=args.seed, extra_configs=extra,
                                  compile_baseline=not args.no_compile)
        except (RuntimeError, ValueError, MemoryError, TritonError) as e:  # (torch's out of memory, CUDA's errors)
            from tuner.worker import one_line

            raise RunError(f"tune bench {shape.label}: {type(e).__name__}: {one_line(e)}") from None
        out = bench.save(res, Path(args.out) / "bench" / shape.label / stamp, ["tune"] + (args.argv or []))
        print(bench.format_table(res))
        print(f"written to {out}")
    return 0


def _bench_config(best: dict, path: str, **expect):
    """A best.json's config, refused (one line, exit 2) when tuned for another schema, shape or GPU:
    its timings would not transfer, and a bench table beside the baselines would mislead."""
    from tuner.config import ConfigError
    from tuner.export import config_of

    try:
        return config_of(best, path, strict=True, **expect)
    except ConfigError as e:
        raise UserError(f"--config {e}") from None


def cmd_verify(args) -> int:
    from dataclasses import replace

    import torch

    from tuner import bench, manifest, verify
    from tuner.device import DeviceInfo
    from tuner.kernels import cluster_gemm
    from tuner.layer import check_config, mlp_fused, mlp_out_fused, qkv_attn_fused

    shapes = _shapes(args.shape)
    dtype = _dtype(args.dtype)
    if args.trials <= 0:
        raise UserError(f"--trials {args.trials}: must be a positive number of race checks")
    _check_writable(_folder(args.out, "--out", "give a folder for the results (default results)"), "--out",
                    "cannot write its results there")
    _need_gpu("tune verify")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for shape in shapes:
        # The norm kernels kept (norms=0): every kernel of the layer is checked for races. On Hopper, also the
        # out-projection and FFN2 split-K reduced in clusters (the CUDA kernel of cluster_gemm.cu).
        hp = bench.hand_picked(shape, norms=0)
        res = verify.run_verify(shape, hp, dtype=dtype, race_trials=args.trials)
        clustered = bench.hand_picked_cluster(shape, norms=0)
        dev = DeviceInfo.from_torch()
        esize = torch.tensor([], dtype=dtype).element_size()
        if clustered != hp and not check_config(clustered, shape, esize, dev):
            res["clustered"] = verify.run_verify(shape, clustered, dtype=dtype, race_trials=args.trials,
                                                 racy_kernels=("out", "ffn2"))
            # and FFN2 in 128x128 tiles split 8 (clusters of 8) where the studies seed it (bert-large)
            square = bench.square_split_ffn2(clustered, shape)
            if square is not None and not check_config(square, shape, esize, dev):
                res["ffn2_split8"] = verify.run_verify(shape, square, dtype=dtype, race_trials=args.trials,
                                                       racy_kernels=("ffn2",))
        # And the feed-forward block as one kernel (ffn2.fuse 1, kernels/mlp_cluster.cu) where it runs.
        mlp = replace(clustered, ffn2=replace(clustered.ffn2, fuse=1))
        if mlp_fused(shape, mlp, dtype, "cuda"):
            res["mlp"] = verify.run_verify(shape, mlp, dtype=dtype, race_trials=args.trials, racy_kernels=("ffn1",))
        # And with the out-projection in front of the block (out.fuse 1; LayerNorm 2 folded in: norms 2), behind
        # the attention kernel.
        mlp_out = bench.hand_picked_cluster(shape, attn_in=False)
        if mlp_out_fused(shape, mlp_out, dtype, "cuda"):
            res["mlp_out"] = verify.run_verify(shape, mlp_out, dtype=dtype, race_trials=args.trials,
                                               racy_kernels=("ffn1",))
        # And with the attention in front of that too (attn.fuse 1), right behind the QKV GEMM.
        mlp_attn = bench.hand_picked_cluster(shape)
        if mlp_attn.attn.fuse and mlp_out_fused(shape, mlp_attn, dtype, "cuda"):
            res["mlp_attn"] = verify.run_verify(shape, mlp_attn, dtype=dtype, race_trials=args.trials,
                                                racy_kernels=("ffn1",))
        # And QKV with the attention in one kernel (qkv.fuse 1, kernels/qkv_attn.cu; LayerNorm 1 folded in: norms
        # 2) where it runs, behind FFN2.
        if mlp_attn.qkv.fuse and qkv_attn_fused(shape, mlp_attn, dtype, "cuda"):
            res["qkv_attn"] = verify.run_verify(shape, mlp_attn, dtype=dtype, race_trials=args.trials,
                                                racy_kernels=("qkv",))
        # And the whole layer as one launch a layer, the layers chained by PDL (layer.fuse): the Triton kernel, and the
        # CUDA one where it runs (fuse 2, Hopper).
        for key, cuda in (("layer", False), ("layer_cuda", True)):
            one = bench.hand_picked_fused(shape, cuda=cuda)
            if (not cuda or cluster_gemm.usable("cuda")) and not check_config(one, shape, esize, dev):
                res[key] = verify.run_verify(shape, one, dtype=dtype, race_trials=args.trials)
        out = Path(args.out) / "verify" / shape.label / stamp
        manifest.write_json_atomic(out / "manifest.json", manifest.make(["tune"] + args.argv, kind="verify",
                                                                         shape=shape.to_dict(), dtype=args.dtype))
        manifest.write_json_atomic(out / "verify.json", res)
        report = verify.format_report(res, f"tune verify: {shape.label} ({dev.name}, {args.dtype})")
        manifest.write_text_atomic(out / "verify.md", report)
        print(report)
        print(f"written to {out}")
    return 0


def _check_storage(url: str) -> str:
    """Open the storage once to check the URL (a missing folder of a SQLite/journal file is created;
    a URL that fails leaves nothing behind)."""
    from tuner.storage import StorageError, open_storage

    try:
        open_storage(url)
    except StorageError as e:
        raise UserError(str(e)) from None
    return url


def _check_decoder_numbers(args) -> None:
    if args.trials is not None and args.trials <= 0:
        raise UserError(f"--trials {args.trials}: must be a positive number of trials")
    if args.timeout is not None and not args.timeout > 0:  # (not > 0: NaN too, which would mean no limit)
        raise UserError(f"--timeout {args.timeout}: must be a positive number of seconds")
    if not args.trial_timeout > 0:
        raise UserError(f"--trial-timeout {args.trial_timeout}: must be a positive number of seconds")
    if args.timeout is None and args.trials is None:  # (a --trials of the user's runs whole: no default time limit)
        args.timeout = DEFAULT_TIMEOUT_S
    if args.top_k <= 0:
        raise UserError(f"--top-k {args.top_k}: must be positive")
    if args.workers is not None and args.workers <= 0:
        raise UserError(f"--workers {args.workers}: must be at least 1 (one study process per GPU)")
    if args.compilers is not None and args.compilers <= 0:
        raise UserError(f"--compilers {args.compilers}: must be at least 1 (1: each candidate compiles in the "
                        "measuring worker)")
    if args.compilers is not None and args.replay:
        raise UserError("--compilers: a replay compiles nothing (its timings are recorded)")
    _check_seed(args.seed)
    _folder(args.out, "--out", "give a folder for the run folders (default results)")


def _check_seed(seed: int) -> None:
    if not 0 <= seed < 2**32 - 1024:  # (each worker samples with seed + its index; Optuna takes 32 bits)
        raise UserError(f"--seed {seed}: must be in 0..{2**32 - 1025}")


def _check_study_name(name: str | None) -> None:
    """A name the storage can hold (Optuna's database column takes 512 characters, and PostgreSQL enforces it) and
    that prints on one line in the logs and the manifest."""
    if name is None:
        return
    if len(name) > MAX_STUDY_NAME:
        raise UserError(f"--study-name: {len(name)} characters; a storage holds names of at most {MAX_STUDY_NAME}")
    if not name.isprintable():
        raise UserError(f"--study-name {name!r}: holds a control character (a newline, a tab, ...); give a name on "
                        "one line")


def _gpus(args) -> list[str | None]:
    """One entry per study process: the GPU it is pinned to, or None (not pinned)."""
    if args.gpus is None:
        n = args.workers or 1
        limit = max(2, os.cpu_count() or 1)
        if args.replay and n > limit:  # (each worker imports torch: a thousand of them exhaust the machine)
            raise UserError(f"--workers {n}: a replay runs at most {limit} worker processes here (one per CPU core; "
                            "more would only share the cores)")
        if args.replay or n == 1:
            return [None] * n
        return [str(i) for i in range(n)]
    if args.replay:
        raise UserError("--gpus pins GPU workers; with --replay nothing runs on a GPU: use --workers N")
    parts = [p.strip() for p in args.gpus.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise UserError(f"--gpus {args.gpus!r}: expected GPU indices separated by commas, e.g. --gpus 0,1,2,3")
    ids = [str(int(p)) for p in parts]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise UserError(f"--gpus {args.gpus!r}: GPU {', '.join(twice)} listed twice (one worker per GPU)")
    if args.workers is not None and args.workers != len(ids):
        raise UserError(f"--workers {args.workers} and --gpus {args.gpus}: {len(ids)} GPUs listed; give one of them")
    return ids


def _check_gpu_indices(gpus: list[str | None]) -> None:
    import torch

    count = torch.cuda.device_count()
    bad = [g for g in gpus if g is not None and int(g) >= count]
    if bad:
        raise UserError(f"--gpus: GPU {', '.join(bad)} does not exist; {count} CUDA GPU(s) visible "
                        f"(indices 0..{count - 1})")


def _check_fits(l2: str, shapes, dtype, gpu: str | None) -> None:
    """--l2 hot only for shapes whose whole model's weights fit in the L2 of the GPU that measures them; and every
    shape's timed stack within the GPU's memory."""
    import torch

    from tuner.device import DeviceInfo
    from tuner.layer import hot_error, memory_error

    dev = f"cuda:{gpu}" if gpu is not None else None
    l2_bytes = DeviceInfo.from_torch(dev).l2_bytes  # (GpuEvaluator's source)
    esize = torch.empty(0, dtype=dtype).element_size()
    total = torch.cuda.get_device_properties(torch.device(dev or "cuda")).total_memory
    for shape in shapes:
        why = (hot_error(shape, esize, l2_bytes) if l2 == "hot" else None) or memory_error(shape, esize, l2_bytes, l2,
                                                                                            total)
        if why:
            raise UserError(why)


def _evaluator_spec(args, shape):
    from tuner import faults
    from tuner.worker import EvaluatorSpec

    if args.replay:
        spec = EvaluatorSpec("replay", {"path": args.replay, "shape": shape})
    else:
        spec = EvaluatorSpec("gpu", {"shape": shape, "dtype": args.dtype, "l2": args.l2, "seed": args.seed})
    try:
        return faults.from_env(spec)  # test-only fault injection (PDL_TUNE_FAULTS), else unchanged
    except ValueError as e:
        raise UserError(str(e)) from None


def _make_evaluator(args, shape, gpu: str | None):
    """In a worker process (isolation: the default on a GPU) or in this process (--no-isolation)."""
    from tuner.worker import IsolatedEvaluator

    spec = _evaluator_spec(args, shape)
    if _isolated(args):
        env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else None
        return IsolatedEvaluator(spec, trial_timeout_s=args.trial_timeout, env=env)
    if spec.kind == "replay" and getattr(args, "checked_replay", None) is not None:
        return args.checked_replay  # read once, when the command line was checked (_decoder_inputs)
    if gpu is not None:
        import torch

        torch.cuda.set_device(int(gpu))
    return spec.build()


def _isolated(args) -> bool:
    return args.isolation if args.isolation is not None else not args.replay


def _close(evaluator) -> None:
    close = getattr(evaluator, "close", None)
    if close is not None:
        close()


def _worker_argv(args, shape, url: str):
    """The command line of worker ``index`` of a --workers/--gpus run: a search-only `tune decoder`."""

    def argv(index: int, name: str) -> list[str]:
        out = ["decoder", "--shape", shape.spec, "--dtype", args.dtype, "--l2", args.l2,
               "--trials", str(args.trials or DEFAULT_TRIALS), "--sampler", args.sampler, "--seed", str(args.seed),
               "--storage", url, "--study-name", name, "--out", args.out, "--trial-timeout", str(args.trial_timeout),
               "--isolation" if _isolated(args) else "--no-isolation", "--no-progress",
               "--search-only", "--workers", str(args.workers or len(args.gpus.split(","))),
               "--worker-index", str(index)]
        if args.timeout is not None:
            out += ["--timeout", str(args.timeout)]
        if args.compilers is not None:
            out += ["--compilers", str(args.compilers)]
        if args.search_space:
            out += ["--search-space", args.search_space]
        if args.replay:
            out += ["--replay", args.replay]
        return out

    return argv


def _no_blanks(args, names) -> None:
    """A flag given an empty or blank value (``--storage "$UNSET"`` in a script) is refused, not read as not given."""
    for name in names:
        v = getattr(args, name, None)
        if isinstance(v, str) and not v.strip():
            raise UserError(f"--{name.replace('_', '-')} {v!r}: empty; give a value or leave the flag out")


def _decoder_inputs(args):
    """Check every input of `tune decoder` before anything is created (no results/, no studies.db for a
    typo). Returns the shapes (the recording's for --replay), the search space and the workers' GPUs."""
    _no_blanks(args, ("shape_file", "storage", "study_name", "replay", "search_space"))
    _check_study_name(args.study_name)
    shapes = _shapes(args.shape, args.shape_file)
    _check_decoder_numbers(args)  # (both before the imports below, which load torch: a typo fails at once)
    from tuner import space as space_mod
    from tuner.study import SAMPLERS

    if args.dtype is not None:
        _dtype(args.dtype)
    if args.sampler not in SAMPLERS:
        raise UserError(f"--sampler {args.sampler}: choose one of {', '.join(SAMPLERS)}")
    try:
        space = space_mod.load(args.search_space)
    except space_mod.SpaceError as e:
        raise UserError(str(e)) from None
    _check_sampler(args.sampler, space)
    # A worker of a --workers run is already pinned (CUDA_VISIBLE_DEVICES) and is one of --workers.
    gpus = [None] if args.search_only else _gpus(args)
    if args.search_only and len(shapes) > 1:
        raise UserError("--search-only: one shape per worker")
    if not args.replay:
        args.dtype, args.l2 = args.dtype or "float16", args.l2 or "cold"
        _need_gpu("tune decoder")
        _check_gpu_indices(gpus)
        _check_fits(args.l2, shapes, _dtype(args.dtype), gpus[0])
        return shapes, space, gpus
    if len(shapes) > 1:
        raise UserError("--replay serves one recording, i.e. one shape: give one --shape")
    args.replay = _replay_path(args.replay)
    # Read the recording now: a wrong one is the user's mistake, reported before anything is written.
    rec = args.checked_replay = _check_replay(args, shapes[0] if args.shape or args.shape_file else None)
    # A replay serves what was measured: its dtype and L2 policy, which the tables and best.json then name.
    measured = {"--dtype": rec.dtype_name, "--l2": rec.l2}
    for flag, given in (("--dtype", args.dtype), ("--l2", args.l2)):
        if given is not None and given != measured[flag]:
            raise UserError(f"{flag} {given}: --replay {args.replay} was measured with {flag} {measured[flag]}, and a "
                            "replay serves only what was measured")
    args.dtype, args.l2 = measured["--dtype"], measured["--l2"]
    return [rec.shape], space, gpus


def cmd_decoder(args) -> int:
    shapes, space, gpus = _decoder_inputs(args)
    from tuner.storage import default_url
    from tuner.study import StudyOptions

    out_root = Path(args.out)
    if not args.search_only:
        _check_writable(out_root)
    url = _check_storage(args.storage or default_url(out_root, len(gpus)))
    opts = StudyOptions(trials=args.trials or DEFAULT_TRIALS, timeout_s=args.timeout, sampler=args.sampler,
                        seed=args.seed, storage=url, study_name=args.study_name, top_k=args.top_k, dtype=args.dtype,
                        l2=args.l2, progress=not args.no_progress, worker_index=args.worker_index,
                        workers=(args.workers or 1) if args.search_only else len(gpus))
    from tuner.worker import auto_compilers

    opts.compilers = 1 if args.replay else (args.compilers or auto_compilers(opts.workers))
    if args.search_only:
        return _search_only(args, shapes[0], space, opts, gpus[0])
    runs, problems = [], []
    for shape in shapes:
        run, failed = _decoder_run(args, shape, space, opts, out_root, gpus, url)
        runs.append(run)
        problems += failed
        print((run / "topk.md").read_text())
        print(f"run folder: {run}")
    if len(runs) > 1:
        _write_summary(runs, out_root)
    if problems:
        print("tune: some workers failed (their trials are kept): " + "; ".join(problems), file=sys.stderr)
        return EXIT_FAILED
    return 0


def _folder(value: str, flag: str, hint: str) -> Path:
    """``value`` of ``flag`` as a folder; a blank one (which Path would read as this folder) is refused."""
    if not value.strip():
        raise UserError(f"{flag} {value!r}: {hint}")
    return Path(value)


def _check_writable(out_root: Path, flag: str = "--out", what: str = "cannot write run folders there") -> None:
    """The run folders go under ``out_root``: found out now, not after the search (its trials would be kept in the
    storage, but the tables, plots and best.json would be missing). Nothing is left behind: the probe is a temporary
    file in ``out_root`` or, where that does not exist yet, in the folder it would be created in."""
    why = _unwritable(out_root)
    if why:
        raise UserError(f"{flag} {out_root}: {what} ({why})")


def _unwritable(folder: Path) -> str | None:
    """Why files cannot be created in ``folder`` (or in the folder it would be created in); None when they can."""
    import errno
    import tempfile

    here = folder.absolute()
    while not here.exists() and here.parent != here:
        if here.is_symlink():  # a link to nothing, or a loop of links: no folder can be created there
            return f"{here} is a symbolic link that leads to no folder"
        here = here.parent
    try:
        if not here.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(here))
        with tempfile.TemporaryFile(dir=here):
            pass
    except OSError as e:
        return _why(e)
    return None


def _write_summary(runs: list[Path], out_root: Path) -> None:
    from tuner import report

    # summary.md is the latest (DESIGN's layout); the stamped copy keeps every earlier one.
    path = out_root / f"summary-{time.strftime('%Y%m%d-%H%M%S')}.md"
    loaded = [report.load_run(r) for r in runs]
    report.write_summary(loaded, path)
    report.write_summary(loaded, out_root / "summary.md")
    print(path.read_text())
    print(f"summary: {path} (and {out_root / 'summary.md'})")


def _check_sampler(name: str, space) -> None:
    """The sampler's own refusals (a grid too large to list, a numeric-only sampler over choices, a package missing),
    before anything is written."""
    from tuner.study import StudyError, make_sampler

    try:
        make_sampler(name, 0, space, pdl=True)
    except StudyError as e:
        raise UserError(str(e)) from None


def _replay_path(given: str) -> str:
    """The recording --replay names: the path as given, else the recording shipped in the package under that name
    (`--replay replay-bert-base-h200`; the README's `tests/data/replay-bert-base-h200` from outside a checkout)."""
    if Path(given).exists():
        return given
    shipped = _recordings()
    name = Path(given).name
    # (only as a bare name or the README's tests/data/ form: another missing path that ends in such a name is a typo
    # of the user's own folder, not the shipped recording)
    if name in shipped and Path(given).parent.as_posix() in (".", "tests/data"):
        return str(shipped[name])
    raise UserError(f"--replay {given}: no such file or folder (recordings shipped with pdl-tune: "
                    f"{', '.join(sorted(shipped)) or 'none in this install'})")


def _check_replay(args, shape):
    from tuner.evaluate import ReplayEvaluator

    try:
        return ReplayEvaluator(args.replay, shape)
    except (ValueError, OSError, KeyError) as e:
        why = str(e).splitlines()[0]
        raise UserError(f"--replay {args.replay}: {why.removeprefix(f'replay recording {args.replay}: ')}") from None


def _decoder_run(args, shape, space, opts, out_root: Path, gpus, url: str):
    """One shape: the study in this process, or spread over workers. Returns (run folder, failures)."""
    from tuner.parallel import run_workers
    from tuner.storage import redact
    from tuner.study import StudyError, run_study
    from tuner.worker import WorkerError

    command = ["tune"] + [redact(a) for a in args.argv]  # (the manifest's command line: no storage password)
    ev = _make_evaluator(args, shape, gpus[0])
    try:
        if args.replay:
            print(f"REPLAYING {args.replay}: timings recorded on {ev.device_name}, nothing is measured now")
        elif ev.device is not None and ev.device.capability == (9, 0) and not ev.device.nvcc:
            print("note: nvcc (the CUDA toolkit) is not on PATH or in $CUDA_HOME/bin: the search leaves out the CUDA "
                  "kernels (clusters, the attention in QKV's kernel, the feed-forward block, the CUDA layer kernel)")
        if len(gpus) > 1:
            return run_workers(shape, ev, space, opts, out_root, command, gpus, _worker_argv(args, shape, url))
        return run_study(shape, ev, space, opts, out_root, command), []
    except (StudyError, ValueError, FileNotFoundError) as e:
        raise UserError(str(e).splitlines()[0]) from None
    except OSError as e:  # e.g. the disk filled up while the run folder was written
        raise RunError(f"{e.filename or out_root}: {_why(e)}; the study's trials are kept in "
                       f"{redact(url)}: run the same command again to write the run folder") from None
    except WorkerError as e:
        raise RunError(str(e)) from None
    except Exception as e:  # the study storage failed under Optuna, which may raise something else on top
        os_err = _in_chain(e, OSError)
        if os_err is not None:  # e.g. a full disk under a journal: Optuna's handling of it ends in an AssertionError
            raise RunError(f"{os_err.filename or redact(url)}: {_why(os_err)} while the study storage was written; "
                           f"the trials completed before it are kept in {redact(url)}: run the same command again "
                           "once that is mended") from None
        if _storage_failure(e):  # e.g. a SQLite file damaged inside its pages (its header passed _check_storage)
            raise RunError(f"the study storage {redact(url)} cannot be read or written ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]}); move the damaged file aside to start a new study"
                           ) from None
        raise
    finally:
        _close(ev)


def _in_chain(e: BaseException, kind: type) -> BaseException | None:
    """The first exception of type ``kind`` among ``e`` and the exceptions it was raised from or while handling."""
    return next((x for x in _chain(e) if isinstance(x, kind)), None)


def _storage_failure(e: BaseException) -> bool:
    """Whether ``e`` (or what it was raised from) is the study storage's own failure: Optuna's storage errors and
    SQLAlchemy's."""
    import optuna

    return any(isinstance(x, optuna.exceptions.StorageInternalError) or type(x).__module__.startswith("sqlalchemy")
               for x in _chain(e))


def _chain(e: BaseException):
    """``e``, then what it was raised from or while handling, and so on."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _search_only(args, shape, space, opts, gpu) -> int:
    """A worker of a --workers/--gpus run: search until the study's budget is spent (the first worker: with the
    top-1's knobs-off twin, tuner.study.search_and_twin), then exit."""
    from tuner.study import StudyError, open_study, search_and_twin
    from tuner.worker import WorkerError, exit_with_parent

    exit_with_parent(os.getppid())  # a killed parent takes its workers with it
    where = f"worker {args.worker_index}" + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                                             if "CUDA_VISIBLE_DEVICES" in os.environ else "")
    ev = _make_evaluator(args, shape, gpu)
    try:
        study = open_study(shape, ev, space, opts, Path(args.out))
        times = search_and_twin(study, shape, ev, space, opts)
        if times.measured:  # (a replay's look-ups are not counted)
            print(f"{shape.label}: {where}: {times.describe()}")
    except (StudyError, ValueError) as e:
        raise UserError(f"{where}: {str(e).splitlines()[0]}") from None
    except WorkerError as e:
        raise RunError(f"{where}: {e}") from None
    finally:
        _close(ev)
    return 0


def _run_dir(path: str) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"{path}: not a run folder (expected results/<shape>/<run-id>/)")
    if p.resolve().name.endswith(".partial"):  # (study.finish writes a run folder under this name, then renames it)
        raise UserError(f"{path}: the unfinished folder of a run stopped while it wrote its results; its trials are "
                        "kept in the study storage: run the same `tune decoder` command again for the whole run folder")
    return p


def cmd_report(args) -> int:
    from tuner import report

    run = _run_dir(args.run)
    skipped: list[str] = []
    try:
        written = report.write_reports(run, skipped)
    except report.RunFolderError as e:
        raise UserError(str(e)) from None
    except OSError as e:  # a read-only folder, a plots file where the folder goes, ...
        where = e.filename or run
        raise UserError(f"{where}: cannot write the reports there ({_why(e)})") from None
    print((run / "topk.md").read_text())
    for w in written:
        print(f"written {w}")
    if skipped:  # (the tables and the other plots are written; the damaged value is the user's to mend)
        raise UserError(f"{run}: {'; '.join(skipped)}")
    return 0


def cmd_export(args) -> int:
    import json

    from tuner.config import ConfigError, DecoderConfig
    from tuner.export import ranked
    from tuner.manifest import write_json_atomic

    run = _run_dir(args.run)
    if args.rank < 1:
        raise UserError(f"--rank {args.rank}: must be 1 (the top-1, best.json) or more")
    try:
        best = ranked(run, args.rank)
        cfg = DecoderConfig.from_dict(best["config"])  # what `tune bench --config` and load_config will read
    except ConfigError as e:
        raise UserError(f"{run}: {e}" if str(run) not in str(e) else str(e)) from None
    # A configuration that cannot run its own shape is not exported. The tuner writes the shape into best.json; a
    # best.json without one (edited by hand) is checked against the shape of its run's manifest.
    what = "best.json" if args.rank == 1 else f"rank {args.rank}"
    manifest = _run_manifest(run)
    shape_of, where = best.get("shape"), "best.json's"
    if shape_of is None:
        shape_of, where = manifest.get("shape"), "the run's manifest's"
        shape_of = shape_of if isinstance(shape_of, dict) else None
        if shape_of is None:
            print(f"tune: note: {run}: neither best.json nor a manifest names the shape: the configuration is not "
                  "checked against one", file=sys.stderr)
    if shape_of is not None:
        from tuner.layer import check_config, element_bytes
        from tuner.shapes import DecoderShape, ShapeError

        try:
            shape = DecoderShape.from_dict(shape_of)
        except ShapeError as e:
            raise UserError(f"{run}: {where} shape: {e}") from None
        dtype = best.get("dtype") or manifest.get("dtype")  # (a hand-edited best.json may lack it)
        bad = check_config(cfg, shape, element_bytes(dtype))
        if bad:
            raise UserError(f"{run}: {what}'s config cannot run its shape {shape.spec}: "
                            + "; ".join(f"{k}: {v}" for k, v in bad.items()))
    if args.output is not None:
        if not args.output.strip():
            raise UserError(f"-o {args.output!r}: give a file name")
        out = Path(args.output)
        if args.output.endswith(("/", os.sep)) or out.is_dir():
            raise UserError(f"-o {args.output}: names a folder; give a file name")
        if out.exists() and not out.is_file():  # a device, a FIFO, ...: never replaced, --force or not
            raise UserError(f"-o {args.output}: exists and is not a regular file")
        if out.exists() and not args.force:
            raise UserError(f"-o {args.output}: a file of that name exists; give another name, or --force to "
                            "replace it")
        why = _unwritable(out.parent)  # (e.g. a path under a file)
        if why:
            raise UserError(f"-o {args.output}: cannot write it in {out.parent} ({why})")
        try:
            write_json_atomic(out, best)
        except OSError as e:
            raise UserError(f"-o {args.output}: cannot write it ({_why(e)})") from None
        print(f"written {args.output}")
    else:
        print(json.dumps(best, indent=2))
    if best.get("replayed"):  # (stderr: the JSON on stdout stays whole)
        print(f"tune: note: {run} was replayed: its timings were served from a recording"
              + (f", the {'top-1' if args.rank == 1 else f'rank {args.rank}'}'s from the nearest recorded "
                 "configuration" if best.get("approximated") else "")
              + ", not measured", file=sys.stderr)
    return 0


def _run_manifest(run: Path) -> dict:
    """A run folder's manifest.json; empty where it has none (or none that reads as a mapping)."""
    from tuner.manifest import read_json

    try:
        m = read_json(run / "manifest.json")
    except ValueError:  # (missing, unreadable, not JSON)
        return {}
    return m if isinstance(m, dict) else {}


NOTEBOOK = "analysis.ipynb"


def cmd_notebook(args) -> int:
    """Copy the analysis notebook shipped with the package into ``--out``: for an installed pdl-tune, which has no
    checkout with its notebooks/ folder. An existing notebook there is never replaced (it may hold the user's edits)."""
    import importlib.resources

    out = _folder(args.out, "--out", "give a folder (. for this one)")
    _check_writable(out, "--out", "cannot write the notebook there")  # (also where --out is a file)
    dest = out / NOTEBOOK
    text = (importlib.resources.files("tuner.notebooks") / NOTEBOOK).read_bytes()
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(dest, "xb") as f:  # exclusive: an existing notebook is never replaced
            f.write(text)
    except FileExistsError:
        raise UserError(f"{dest}: a notebook of that name exists; it is kept (give another --out, or remove it)"
                        ) from None
    except OSError as e:
        raise UserError(f"{dest}: cannot write it ({_why(e)})") from None
    print(f"written {dest}\n"
          f"it reads the runs under the nearest results/ folder at or above {out.absolute()} (tune decoder's default "
          f"--out), or the run folder in its RUN_DIR (or $PDL_TUNE_RUN); open it with: jupyter lab {dest} "
          "(JupyterLab is not a dependency of pdl-tune: pip install jupyterlab)")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with its mistakes in one line (argparse prints the whole usage first) and exit code 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from tuner import __version__

    p = _Parser(prog="tune", description="pdl-tune: search the tiles and the PDL overlap and L2 prefetch ratios of a "
                "transformer layer's kernels on the GPU, each candidate checked and timed as a whole layer stack in a "
                "CUDA graph. `tune COMMAND --help` explains each command.")
    p.add_argument("--version", action="version", version=f"pdl-tune {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("shapes", help="list the shape presets")
    s.set_defaults(func=cmd_shapes)

    b = sub.add_parser("bench", help="our layer against torch eager, torch.compile and the memory floor")
    b.add_argument("--shape", action="append",
                   help="preset, BxSxDxHxF or 'all' (repeatable); default: the --config's shape, else bert-base")
    b.add_argument("--shape-file")
    b.add_argument("--dtype", help="float16, bfloat16 or float32 (default: the --config's, else float16)")
    b.add_argument("--l2", choices=["cold", "hot"], default="cold",
                   help="cold: a stack of layers whose weights are >= 3x the L2 (default); hot: the shape's depth "
                   "of layers")
    b.add_argument("--reps", type=int, default=50, help="timed graph replays a row (default 50)")
    b.add_argument("--seed", type=int, default=0, help="seed of the weights and inputs (default 0)")
    b.add_argument("--config", help="a best.json to measure beside the baselines")
    b.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    b.add_argument("--out", default="results")
    b.set_defaults(func=cmd_bench)

    d = sub.add_parser("decoder", help="tune a decoder layer (Optuna study on the GPU, or --replay)")
    d.add_argument("--shape", action="append", help="preset, BxSxDxHxF or 'all' (repeatable); default bert-base")
    d.add_argument("--shape-file", help="YAML list of shapes (batch, seq, d_model, heads, ffn)")
    d.add_argument("--trials", type=int, default=None,
                   help=f"the study's total trial budget, shared by all workers (default {DEFAULT_TRIALS})")
    d.add_argument("--timeout", type=float, default=None,
                   help=f"seconds of search per shape (default {DEFAULT_TIMEOUT_S:.0f}, about 3 minutes a shape with "
                        "the final phase, where --trials is not given; with --trials, none: the trials decide)")
    d.add_argument("--sampler", default="tpe", help="tpe|random|grid|cmaes|gp|qmc (default tpe)")
    d.add_argument("--seed", type=int, default=0,
                   help="seed of the sampler, the local steps and the weights and checks (default 0)")
    d.add_argument("--storage", help="Optuna storage URL: sqlite:///PATH (default <out>/studies.db), journal:PATH "
                                     "(default <out>/studies.journal with --workers), postgresql://... (several hosts)")
    d.add_argument("--study-name", help="join this study (several hosts: the same name and --storage on each)")
    d.add_argument("--top-k", type=int, default=10,
                   help="configurations re-measured beside the baseline at the end and tabled (default 10)")
    d.add_argument("--dtype", help="float16 (default), bfloat16 or float32; with --replay, the recording's")
    d.add_argument("--l2", choices=["cold", "hot"], help="cold (default) or hot; with --replay, the recording's")
    d.add_argument("--out", default="results", help="folder for the run folders <shape>/<run-id>/ (default results)")
    d.add_argument("--search-space", help="a YAML search space file, or a shipped one by name: fused-layer, "
                                          "layer-kernel (default: the shipped decoder)")
    d.add_argument("--replay", help="serve timings from a recorded run folder or trials.csv, or a shipped recording by "
                   f"name: {', '.join(shipped_recordings()) or 'none in this install'} (no GPU needed)")
    d.add_argument("--workers", type=int, help="study processes on one study, one per GPU (GPUs 0..N-1)")
    d.add_argument("--gpus", help="the GPUs of the workers, e.g. 0,1,2,3 (one worker each)")
    d.add_argument("--compilers", type=int,
                   help="compile workers of each study process: candidates compile side by side while another is "
                        "measured (default: the CPUs less two a process, at most 12; 1: each compiles in the "
                        "measuring worker)")
    d.add_argument("--isolation", action=argparse.BooleanOptionalAction, default=None,
                   help="compile and run candidates in a supervised worker process (default: on a GPU, yes)")
    d.add_argument("--trial-timeout", type=float, default=120.0,
                   help="seconds before an isolated trial is killed as 'timeout' (default 120; the first trial "
                        "of a worker gets 180 s more for compiling)")
    d.add_argument("--no-progress", action="store_true", help="no progress bar")
    # Internal: how the parent of a --workers run starts its workers.
    d.add_argument("--search-only", action="store_true", help=argparse.SUPPRESS)
    d.add_argument("--worker-index", type=int, default=0, help=argparse.SUPPRESS)
    d.set_defaults(func=cmd_decoder)

    r = sub.add_parser("report", help="re-draw tables and plots of a run folder")
    r.add_argument("run")
    r.set_defaults(func=cmd_report)

    e = sub.add_parser("export", help="the best configuration of a run as JSON")
    e.add_argument("run")
    e.add_argument("-o", "--output", help="write it to this file (default: print it); an existing file is kept")
    e.add_argument("--force", action="store_true", help="with -o: replace an existing file")
    e.add_argument("--rank", type=int, default=1,
                   help="export the configuration of this rank of the run's top-k table (default 1: best.json); "
                        "its latency, spread and speedup as the table has them")
    e.set_defaults(func=cmd_export)

    n = sub.add_parser("notebook", help="copy the analysis notebook into a folder (for an installed copy)",
                       description="Write analysis.ipynb, the notebook that analyses a run folder (tables, plots, "
                       "two runs side by side; no GPU needed), into --out. In a checkout it is "
                       "notebooks/analysis.ipynb; an installed pdl-tune has no checkout, so this writes the copy "
                       "shipped with the package. An existing analysis.ipynb there is kept.")
    n.add_argument("--out", default=".", help="folder to write analysis.ipynb into (default: this folder)")
    n.set_defaults(func=cmd_notebook)

    v = sub.add_parser("verify", help="show the PDL chain (which launches carry PDL) and that the gate catches races",
                       description="For hand-picked configurations of each kind of kernel the tuner can launch: "
                       "count the launches that carry the PDL attribute, and run each kernel's test-only racy "
                       "variant (it reads its input too early: before griddepcontrol.wait, or before the readiness "
                       "flags of the CUDA layer kernel's phases) through the correctness check, with and without the "
                       "defect. "
                       "Writes results/verify/<shape>/<stamp>/ (verify.json, verify.md, manifest.json) and prints "
                       "verify.md.")
    v.add_argument("--shape", action="append", help="preset, BxSxDxHxF or 'all' (repeatable); default bert-base")
    v.add_argument("--dtype", default="float16", help="float16, bfloat16 or float32 (default float16)")
    v.add_argument("--trials", type=int, default=20,
                   help="race checks a racy kernel, each on fresh poisoned inputs; as many without the defect "
                   "(default 20)")
    v.add_argument("--out", default="results", help="folder for the verify/ run folders (default results)")
    v.set_defaults(func=cmd_verify)
    p.commands = sub.choices  # (main names a subcommand's unknown arguments by its own parser)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the subcommand's parser, whose --help lists what it takes
            parser.commands[args.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse already printed its one-line error (_Parser), or --help
        return int(e.code or 0)
    args.argv = argv
    hook = threading.excepthook
    threading.excepthook = _thread_failed
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except RunError as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("tune: interrupted; completed trials are kept in the study storage", file=sys.stderr)
        return 130
    except OSError as e:  # a path the system refuses (too long, no permission, ...) that no check above caught
        where = f"{e.filename}: " if e.filename else ""
        print(f"tune: error: {where}{_why(e)}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        if not _interrupted(e):
            raise
        print("tune: interrupted; completed trials are kept in the study storage", file=sys.stderr)
        return 130
    finally:
        threading.excepthook = hook


def _interrupted(e: BaseException) -> bool:
    """Whether a Ctrl-C is behind ``e``: Optuna 5.0 turns one that lands while it records a trial (its
    ``_run_trial`` after the objective) into an ``UnboundLocalError`` raised from the KeyboardInterrupt."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


_THREAD_FAILURES: set[str] = set()


def _thread_failed(args: threading.ExceptHookArgs) -> None:
    """A background thread's exception in one line, not a traceback; the run goes on. The thread is Optuna's
    heartbeat (RDB storages: a storage that fails only there, e.g. a SQLite file damaged in that table) or a
    progress or pipe reader; the main thread reports its own failures."""
    from tuner.worker import one_line

    if args.exc_type is SystemExit or args.exc_value is None:
        return
    line = one_line(args.exc_value)
    if line in _THREAD_FAILURES:  # (a heartbeat thread a trial: said once)
        return
    _THREAD_FAILURES.add(line)
    thread = args.thread.name if args.thread else "?"
    what = (f"the study storage failed in a background thread ({thread}): other hosts may take this process's running "
            "trial as stale" if _storage_failure(args.exc_value) else f"a background thread ({thread}) failed")
    print(f"tune: warning: {what}: {line}; the run goes on", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
