"""Who, where and how a result was measured: every results file carries one of these."""

from __future__ import annotations

import json
import math
import numbers
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

MANIFEST_SCHEMA_VERSION = 1


def why(e: Exception) -> str:
    """A file's read or write error in a few words: the system's (No space left on device), else its kind
    (UnicodeDecodeError)."""
    return getattr(e, "strerror", None) or type(e).__name__


def read_json(path: Path):
    """A JSON file's content, or ValueError with one line of why (the caller names the file): unreadable, not UTF-8,
    or not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot be read ({why(e)})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ValueError("not readable JSON (nested too deeply)") from None


def is_int(v) -> bool:
    """An integer in JSON's sense: Python's bool is an int, but true is not 1 here."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite number, as JSON or a table gives it (numpy's too): not a bool, not text, not NaN or infinity."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # (an int past a float's range: no figure either)
        return False


def breakdown_problem(b) -> str | None:
    """Why a run's breakdown.json (``b``, as read) cannot be shown or replayed; None when it can. The study writes
    {"best": {kernel: us}, "baseline": {kernel: us}, "floor_us": us}; either mapping may be null (not measured)."""
    if not isinstance(b, dict):
        return f"must be a mapping, not {type(b).__name__}"
    for k in ("best", "baseline"):
        v = b.get(k)
        if v is not None and not (isinstance(v, dict) and all(is_number(x) for x in v.values())):
            return "must map 'best' and 'baseline' to per-kernel figures (finite numbers)"
    if b.get("floor_us") is not None and not is_number(b["floor_us"]):
        return "'floor_us' must be a finite number"
    return None


def trials_cut_short(data: bytes, trials, manifest: dict) -> str | None:
    """Why a run's trials.csv (its bytes, read as ``trials``) lost its end, a copy or a disk cut short; None when
    whole. Read from it, the tables, plots or a replay would silently have fewer trials than the study ran."""
    if data and not data.endswith(b"\n"):
        return "ends in the middle of a line (cut short?)"
    n = manifest.get("n_trials")
    have = int((trials["status"] != "interrupted").sum())
    if is_int(n) and have < n:
        return f"has {have} trials, manifest.json's n_trials says {n} (cut short?)"
    return None


def read_table(path: Path, with_bytes: bool = False):
    """A run's trials.csv as a pandas DataFrame (with ``with_bytes``, and the file's bytes, read once), or ValueError
    with one line of why (the caller names the file)."""
    import io

    import pandas as pd

    try:
        data = Path(path).read_bytes()
        df = pd.read_csv(io.BytesIO(data))
    except (OSError, ValueError) as e:  # (pandas' parser and empty-file errors and UnicodeDecodeError are ValueErrors)
        detail = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"cannot be read as a table of trials ({detail})") from None
    return (df, data) if with_bytes else df


def git_revision() -> str:
    rev = os.environ.get("PDL_TUNE_GIT_REV")
    if rev:
        return rev
    try:
        here = Path(__file__).resolve().parent
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def environment() -> dict:
    import torch
    import triton

    import tuner

    # (pdl_tune: the package's own version, the provenance an installed copy has where git_revision is "unknown")
    env = {"pdl_tune": tuner.__version__, "python": sys.version.split()[0], "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda}
    try:
        import optuna

        env["optuna"] = optuna.__version__
    except ImportError:
        env["optuna"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = {"name": p.name, "capability": [p.major, p.minor], "sms": p.multi_processor_count,
                      "l2_bytes": int(getattr(p, "L2_cache_size", 0)), "memory_bytes": int(p.total_memory)}
        try:
            # (one line a GPU; one driver serves them all)
            lines = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=10).stdout.split()
            env["driver"] = lines[0] if lines else None
        except Exception:
            env["driver"] = None
    else:
        env["gpu"] = None
    return env


def make(command: list[str] | None = None, **extra) -> dict:
    m = {"schema_version": MANIFEST_SCHEMA_VERSION,
         "command": " ".join(command if command is not None else sys.argv),
         "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
         "git_revision": git_revision(), **environment()}
    m.update(extra)
    return m


def write_json_atomic(path: Path, obj) -> None:
    """Write to a temporary name and rename: a killed process never leaves half a file."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def temp_name(path: Path) -> Path:
    """A fresh hidden name beside ``path`` for writing before the rename: never a file of the user's (such as
    PATH.tmp), nor another process's temporary."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, text, "x")


def write_bytes_atomic(path: Path, data: bytes) -> None:
    _write_atomic(path, data, "xb")


def _write_atomic(path: Path, data, mode: str) -> None:
    """``data`` to a fresh temporary name beside ``path``, opened exclusively (``mode`` "x" or "xb": an existing file
    of that name is never overwritten), then renamed: a killed process never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with open(tmp, mode) as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # (where the rename failed, e.g. onto a folder: no stray .tmp left)
        raise
