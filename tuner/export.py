"""best.json: the exported configuration, and loading it back into the layer runtime."""

from __future__ import annotations

import warnings
from pathlib import Path

from tuner.config import ConfigError, DecoderConfig
from tuner.manifest import read_json
from tuner.shapes import DecoderShape

BEST_SCHEMA_VERSION = 1


class ConfigMismatchWarning(UserWarning):
    """best.json was tuned for another shape or GPU model (it runs, but its timings do not transfer), or chosen in a
    replay (its timing was served, not measured)."""


def read_best(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "best.json"
    if not p.is_file():
        raise ConfigError(f"{path}: no best.json found")
    try:
        d = read_json(p)
    except ValueError as e:
        raise ConfigError(f"{p}: {e}") from None
    if not isinstance(d, dict) or d.get("schema_version") != BEST_SCHEMA_VERSION:
        v = d.get("schema_version") if isinstance(d, dict) else None
        raise ConfigError(f"{p}: best.json schema_version {v!r} is not supported (expected {BEST_SCHEMA_VERSION})")
    if not isinstance(d.get("config"), dict):
        raise ConfigError(f"{p}: best.json has no 'config' mapping")
    for key in ("shape", "gpu"):  # optional, but where present what load_config and `tune bench` read
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ConfigError(f"{p}: best.json's '{key}' must be a mapping, not {type(d[key]).__name__}")
    from tuner.layer import DTYPES

    dtype = d.get("dtype")  # (a misspelt one would count as float16's 2 bytes, silently)
    if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPES):
        raise ConfigError(f"{p}: best.json's dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return d


def ranked(path: str | Path, rank: int) -> dict:
    """best.json with the configuration of row ``rank`` of the run's top-k table (topk.json) in place of the
    top-1's: its latency, spread and speedup as the table has them (the re-measurement of the top-k, interleaved
    with the baseline), ``rank`` added, and the knobs-off figure (the top-1's own) left out. Rank 1 is best.json."""
    d = read_best(path)
    if rank == 1:
        return d
    run = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        topk = read_json(run / "topk.json")
        rows = topk["rows"]
        n = len(rows)
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{run}: no readable topk.json, which --rank reads") from None
    if not 1 <= rank <= n:
        raise ConfigError(f"--rank {rank}: {run}'s top-k table has ranks 1 to {n}")
    row = next((r for r in rows if isinstance(r, dict) and r.get("rank") == rank), None)
    if row is None or not isinstance(row.get("config"), dict):
        raise ConfigError(f"{run}: topk.json has no configuration at rank {rank}")
    out = {k: v for k, v in d.items() if k not in ("knobs_off_us", "approximated")}
    out.update(rank=rank, config=row["config"], latency_us=row.get("latency_us"), spread_us=row.get("spread_us"),
               speedup=row.get("speedup"), trial=row.get("trial"))
    if d.get("replayed"):
        out["approximated"] = bool(row.get("approximated"))
    return out


def load_config(path: str | Path, *, shape: DecoderShape | str | None = None, gpu: str | None = None,
                dtype=None, strict: bool = False) -> DecoderConfig:
    """The DecoderConfig of a best.json (or run folder). Loading it for another shape, GPU model or dtype (a torch
    dtype or its name) warns (``strict=True``: raises ConfigError)."""
    return config_of(read_best(path), path, shape=shape, gpu=gpu, dtype=dtype, strict=strict)


def config_of(d: dict, path: str | Path, *, shape: DecoderShape | str | None = None, gpu: str | None = None,
              dtype=None, strict: bool = False) -> DecoderConfig:
    """:func:`load_config` of a best.json already read (:func:`read_best`) from ``path``, which messages name."""
    try:
        cfg = DecoderConfig.from_dict(d["config"])
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    problems = []
    if shape is not None:
        want = shape if isinstance(shape, DecoderShape) else None
        if want is None:
            from tuner.shapes import resolve

            want = resolve(shape)
        try:
            got = DecoderShape.from_dict(d["shape"]) if d.get("shape") is not None else None
        except ValueError as e:  # ShapeError
            raise ConfigError(f"{path}: best.json's shape: {e}") from None
        if got is not None and got.spec != want.spec:
            problems.append(f"tuned for shape {got.spec}, loaded for {want.spec}")
    if gpu is None:
        try:
            import torch

            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        except Exception:
            gpu = None
    tuned_gpu = (d.get("gpu") or {}).get("name")
    if gpu and tuned_gpu and gpu != tuned_gpu:
        problems.append(f"tuned on {tuned_gpu}, loaded on {gpu}")
    from tuner.layer import dtype_name

    tuned_dtype = d.get("dtype")
    if dtype is not None and isinstance(tuned_dtype, str) and dtype_name(dtype) != tuned_dtype:
        problems.append(f"tuned in {tuned_dtype}, loaded in {dtype_name(dtype)}")
    if d.get("replayed"):
        warnings.warn(f"{path}: chosen in a replay: its timing was served from a recording"
                      + (" (the nearest recorded configuration's)" if d.get("approximated") else "")
                      + ", not measured", ConfigMismatchWarning, stacklevel=2)
    if problems:
        msg = f"{path}: " + "; ".join(problems) + " (the config runs correctly, but its timings do not transfer)"
        if strict:
            raise ConfigError(msg)
        warnings.warn(msg, ConfigMismatchWarning, stacklevel=2)
    return cfg
