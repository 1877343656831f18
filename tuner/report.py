"""Tables and plots of a stored run folder (``results/<shape>/<run-id>/``).

Everything here reads files only: no torch, no triton, no GPU, so ``tune report`` and the notebook
run on any machine. Every table and plot is built in two steps (STYLE habit 9): a pure data function
that returns a DataFrame (``topk_frame``, ``summary_frame``, ``<name>_data``), which the tests check,
and a formatter or renderer that turns it into Markdown or a PNG.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from tuner.manifest import (breakdown_problem, read_json, read_table, trials_cut_short, write_bytes_atomic,
                            write_text_atomic)
# (torch-free: a report opens on a laptop without torch)
from tuner.names import GEMMS, KERNELS, gemm_kernels, reads_l2_hints

# Column titles of the seed's tables (decoder layer, seed 003).
GEMM_TITLES = {"qkv": "QKV", "out": "Output", "ffn1": "FFN1", "ffn2": "FFN2"}
STATUSES = ("ok", "compile_error", "out_of_resources", "incorrect", "timeout", "crashed", "invalid")
ABSURD_US = 1e9  # a latency or spread this large (over 16 minutes a layer) is a damaged file, not a measurement

REPLAYED_LINE = "REPLAYED (timings served from a recording, not measured now)"
TIES_NOTE = ("Ties: rows marked tie differ from the row above by less than their combined spread "
             "(median ± IQR/2)")
REQUIRED_FILES = ("manifest.json", "trials.csv", "topk.json")
PLOTS = ("history", "ratio_plane", "importance", "breakdown", "topk")


class RunFolderError(ValueError):
    """A run folder that cannot be read; the message is one line and names the file(s)."""


@dataclass
class Run:
    path: Path
    manifest: dict
    trials: pd.DataFrame
    topk: dict
    breakdown: dict | None = None
    importance: dict | None = None

    # --- facts every table and title needs, each read in one place ---
    @property
    def shape(self) -> dict:
        return self.manifest.get("shape") or {}

    @property
    def dims(self) -> str:
        s = self.shape
        try:
            return "x".join(str(int(s[k])) for k in ("batch", "seq", "d_model", "heads", "ffn"))
        except (KeyError, TypeError, ValueError):
            return "?"

    @property
    def shape_name(self) -> str:
        return self.shape.get("name") or self.dims

    @property
    def dtype(self) -> str:
        return str(self.manifest.get("dtype") or "?")

    @property
    def gpu_name(self) -> str:
        gpu = self.manifest.get("gpu")
        if isinstance(gpu, dict) and gpu.get("name"):
            return str(gpu["name"])
        return "no GPU"

    @property
    def replayed(self) -> bool:
        return bool(self.manifest.get("replayed") or self.topk.get("replayed"))

    @property
    def l2_policy(self) -> str | None:
        pol = self.manifest.get("policy")
        return str(pol["l2"]) if isinstance(pol, dict) and pol.get("l2") else None

    @property
    def baselines(self) -> dict:
        return self.manifest.get("baselines") or {}

    @property
    def baseline_us(self) -> float | None:
        return _num(self.topk.get("baseline_us"), self.baselines.get("baseline_us"))

    @property
    def baseline_spread_us(self) -> float | None:
        return _num(self.topk.get("baseline_spread_us"))

    @property
    def compile_us(self) -> float | None:
        return _num(self.topk.get("compile_us"), self.baselines.get("compile_us"))

    @property
    def eager_us(self) -> float | None:
        return _num(self.topk.get("eager_us"), self.baselines.get("eager_us"))

    @property
    def floor_us(self) -> float | None:
        return _num((self.breakdown or {}).get("floor_us"), self.baselines.get("floor_us"))

    @property
    def rows(self) -> list[dict]:
        return list(self.topk.get("rows") or [])

    @property
    def best(self) -> dict | None:
        rows = self.rows
        return rows[0] if rows else None


def _num(*values) -> float | None:
    """The first value that is a finite number, else None (JSON null and NaN both mean 'not measured')."""
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError):
            continue
        if math.isfinite(f):
            return f
    return None


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

def _read_json(path: Path, problems: list[str], mapping: bool = False):
    """The file's JSON, or None with the reason in ``problems``; ``mapping``: anything but a JSON object (``null``
    too) is such a reason."""
    if not path.is_file():
        problems.append(f"{path.name} is missing")
        return None
    try:
        content = read_json(path)
    except ValueError as e:
        problems.append(f"{path.name}: {e}")
        return None
    if mapping and not isinstance(content, dict):
        problems.append(f"{path.name} is not a JSON object")
        return None
    return content


def _as_bool(col: pd.Series) -> pd.Series:
    if col.dtype == bool:
        return col
    return col.map(lambda v: str(v).strip().lower() in ("true", "1", "1.0", "yes")).astype(bool)


def _read_trials(path: Path, problems: list[str]) -> tuple[pd.DataFrame | None, bytes]:
    """The table and the bytes it was read from (for trials_cut_short), read once; (None, b"") on a problem."""
    if not path.is_file():
        problems.append(f"{path.name} is missing")
        return None, b""
    try:
        df, data = read_table(path, with_bytes=True)
    except ValueError as e:
        problems.append(f"{path.name}: {e}")
        return None, b""
    missing = [c for c in ("number", "status") if c not in df.columns]
    if missing:
        problems.append(f"{path.name} has no column {', '.join(missing)}")
        return None, b""
    df["status"] = df["status"].astype(str)
    # (an all-empty column reads as float64 NaN, which pandas 3 will not fill with text)
    df["reason"] = df["reason"].astype(object).fillna("").astype(str) if "reason" in df.columns else ""
    number = pd.to_numeric(df["number"], errors="coerce")
    if not (number.notna() & (number % 1 == 0) & (number.abs() < 1e9)).all():
        problems.append(f"{path.name}'s number column holds something other than trial numbers")
        return None, b""
    df["number"] = number.astype(int)
    for c in ("latency_us", "spread_us", "speedup"):  # (float: a column of true/false would stay bool)
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float) if c in df.columns else np.nan
    for c in ("approximated", "is_baseline"):
        df[c] = _as_bool(df[c]) if c in df.columns else False
    return df.sort_values("number", kind="stable").reset_index(drop=True), data


def _fill_speedup(trials: pd.DataFrame, manifest: dict, topk: dict) -> None:
    """speedup = baseline / latency for ok trials whose file has none (runs before trials.csv had the column).
    The baseline is the search's own baseline trial when the manifest has it: the trials were timed
    with the search's repetitions, the topk baseline with the longer interleaved re-measurement."""
    b = manifest.get("baselines") or {}
    base = _num(b.get("search_baseline_us"), topk.get("baseline_us"), b.get("baseline_us"))
    if base is None:
        return
    ok = trials["status"] == "ok"
    missing = ok & trials["speedup"].isna() & (trials["latency_us"] > 0)
    trials.loc[missing, "speedup"] = base / trials.loc[missing, "latency_us"]


def load_run(run_dir) -> Run:
    """Read a run folder. manifest.json, trials.csv and topk.json are required; breakdown.json and
    importance.json are optional (their plots are then skipped)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunFolderError(f"{path}: no such run folder (expected {', '.join(REQUIRED_FILES)} in it)")
    problems: list[str] = []
    manifest = _read_json(path / "manifest.json", problems, mapping=True)
    trials, trials_data = _read_trials(path / "trials.csv", problems)
    topk = _read_json(path / "topk.json", problems, mapping=True)
    if not problems:
        problems += _content_problems(manifest, topk)
    if not problems:
        why = trials_cut_short(trials_data, trials, manifest)
        problems += [f"trials.csv {why}"] if why else []
    if problems:
        raise RunFolderError(f"{path}: " + "; ".join(problems))
    optional: list[str] = []
    breakdown = _read_json(path / "breakdown.json", optional) if (path / "breakdown.json").exists() else None
    importance = _read_json(path / "importance.json", optional) if (path / "importance.json").exists() else None
    if breakdown is not None and (why := breakdown_problem(breakdown)):
        optional.append(f"breakdown.json {why}")
    if optional:  # an optional file that is there but broken is still the user's to know about
        raise RunFolderError(f"{path}: " + "; ".join(optional))
    _fill_speedup(trials, manifest, topk)
    return Run(path=path, manifest=manifest, trials=trials, topk=topk,
               breakdown=breakdown if isinstance(breakdown, dict) else None,
               importance=importance if isinstance(importance, dict) and importance else None)


def _content_problems(manifest: dict, topk: dict) -> list[str]:
    """What of a run folder's JSON the tables and plots read but could not (the files' own words)."""
    out = [f"manifest.json's '{k}' is not a mapping" for k in ("shape", "gpu", "baselines", "policy")
           if manifest.get(k) is not None and not isinstance(manifest[k], dict)]
    rows = topk.get("rows")
    if not isinstance(rows, list):  # (a run where nothing passed writes an empty list)
        out.append("topk.json has no 'rows'" if rows is None else "topk.json's 'rows' is not a list")
    elif rows:
        for i, r in enumerate(rows):
            r = r if isinstance(r, dict) else {}
            cfg = r.get("config") if isinstance(r.get("config"), dict) else {}
            kernels = cfg.get("kernels")
            if (_num(r.get("latency_us")) is None or not isinstance(kernels, dict)
                    or not all(isinstance(v, dict) for v in kernels.values())):
                out.append(f"topk.json's rows[{i}] needs latency_us and config.kernels")
                break
            if (_num(r.get("spread_us")) or 0.0) < 0:
                out.append(f"topk.json's rows[{i}] has a negative spread_us")
                break
            if not all(abs(_num(r.get(k)) or 0.0) < ABSURD_US for k in ("latency_us", "spread_us")):
                out.append(f"topk.json's rows[{i}] has a latency_us or spread_us of {ABSURD_US:g} us or more")
                break
            rank = r.get("rank")
            if "rank" in r and (isinstance(rank, bool) or not isinstance(rank, int)):
                out.append(f"topk.json's rows[{i}] has a rank of {rank!r}, not a whole number")
                break
    return out


# ----------------------------------------------------------------------------------------------
# Formatting helpers
# ----------------------------------------------------------------------------------------------

def _ratio(x) -> str:
    """0.8 -> '0.8', -1 -> '-1.0', 0.35 -> '0.35' (the seed's grid keeps one decimal)."""
    f = _num(x)
    if f is None:
        return "-"
    s = f"{f:.2f}".rstrip("0")
    return s + "0" if s.endswith(".") else s


def format_op(overlap_ratio, prefetch_ratio) -> str:
    """The seed's '(o,p)' cell: '(0.8,0.2)', '(-1.0,-1.0)'."""
    return f"({_ratio(overlap_ratio)},{_ratio(prefetch_ratio)})"


def _us(x, digits: int = 2) -> str:
    f = _num(x)
    return "-" if f is None else f"{f:.{digits}f}"


def _times(x) -> str:
    f = _num(x)
    return "-" if f is None else f"{f:.2f}x"


def _int(v) -> str:
    f = _num(v)
    return "?" if f is None else str(int(f))


def fused_layer(kernels: dict) -> dict | None:
    """The one-kernel layer's config when it is switched on (it then replaces the seven kernels)."""
    c = kernels.get("layer")
    return c if isinstance(c, dict) and _num(c.get("fuse")) in (1, 2) else None


def gemm_op(kernels: dict, g: str) -> str:
    """A GEMM's '(o,p)'; in a fused layer every GEMM runs under the layer's one pair; '-' for FFN2 and the
    out-projection computed by FFN1's kernel (``ffn2.fuse``, ``out.fuse``: a run keeps them only where they ran),
    whose pairs are unused."""
    f = fused_layer(kernels)
    c = f or kernels.get(g) or {}
    if g in ("out", "ffn2") and not f and _num(c.get("fuse")) in ((1,) if g == "out" else (1, 2)):
        return "-"
    return format_op(c.get("overlap_ratio"), c.get("prefetch_ratio")) if c else "-"


def _ln_parts(kernels: dict, gemm: str, shape: dict | None) -> int | None:
    """The producer's row-sum parts that ``gemm`` reads for its folded LayerNorm (QKV under ``norm1.fuse`` 2, FFN1
    under ``norm2.fuse`` 2), from a run file's kernels and the manifest's ``shape``; None where it reads none or the
    shape is not known. The torch-free copy of tuner.layer.ln_parts (gemm.stats_parts, mlp_cluster.stats_parts) for a
    configuration as a run keeps it (repaired: ``ffn2.fuse`` is set only where the feed-forward block ran);
    tests/test_report.py checks the two agree."""
    d, f = _num((shape or {}).get("d_model")), _num((shape or {}).get("ffn"))
    norm, producer = {"qkv": ("norm1", "ffn2"), "ffn1": ("norm2", "out")}.get(gemm, (None, None))
    if norm is None or d is None or f is None or _num((kernels.get(norm) or {}).get("fuse")) != 2:
        return None
    d, f = int(d), int(f)
    ffn2_fuse = _num((kernels.get("ffn2") or {}).get("fuse"))
    if gemm == "qkv" and ffn2_fuse in (1, 2):  # the feed-forward block's: one part a CTA, 128 / SC columns each
        return d // (128 // (f // (64 if ffn2_fuse == 2 else 128)))
    c = kernels.get(producer) or {}  # a GEMM's: a part per column tile, or per 64 columns of its split-K reduction
    block_n, split_k = _num(c.get("block_n")), _num(c.get("split_k", 1))
    if block_n is None or split_k is None:
        return None
    return -(-d // int(block_n if split_k == 1 else 64))


def format_tiles(kernels: dict, shape: dict | None = None) -> str:
    """Compact GEMM tiles: 'qkv 64x64x64/4w3s/sk1; out ...' (BLOCK_MxNxK / warps, stages / split-K, and
    '/tma' where the tiles are loaded by TMA, '/cluster' where the CUDA kernel reduces the split-K in a cluster
    ('/cluster16': partials exchanged in 16 bits), '/l2hints' where a CUDA kernel loads with L2 eviction hints (the
    Triton kernels ignore the field); a clustered GEMM that no layer runs on the cluster kernel (tuner.names.
    gemm_kernels: one that folds a LayerNorm with row sums from its K loop, or from a producer with more parts than
    it reads, judged on the run's ``shape``) shows neither, as the Triton kernels run its tiles; 'ffn2 in ffn1 (mlp)'
    where FFN2 is computed by FFN1's kernel (then 'ffn1 (mlp)': that kernel, the one-kernel feed-forward block, reads
    none of FFN1's tile fields), and
    'out in ffn1 (mlp)' where the out-projection is too, 'attn in ffn1 (mlp)' after QKV where the attention is too,
    'attn in qkv' where QKV's kernel computes it);
    a fused layer: 'layer 64x*x64/8w4s qkv n64/sk1; ...; attn 32x128'; the CUDA layer kernel (fuse 2):
    'layer cuda 64x64x64/10s out sk4; ffn2 sk4'."""
    f = fused_layer(kernels)
    if f is not None and _num(f.get("fuse")) == 2:  # the CUDA layer kernel: 64x64 tiles, a ring of stages
        progs = _int(f.get("programs"))
        return (f"layer cuda 64x64x64/{_int(f.get('num_stages'))}s out sk{_int(f.get('out_split_k'))}; "
                f"ffn2 sk{_int(f.get('ffn2_split_k'))}" + ("" if progs == "0" else f"; {progs} CTAs"))
    if f is not None:
        progs = _int(f.get("programs"))
        return (f"layer {_int(f.get('block_m'))}x*x{_int(f.get('block_k'))}/{_int(f.get('num_warps'))}w"
                f"{_int(f.get('num_stages'))}s " + "; ".join(
                    f"{g} n{_int(f.get(f'{g}_block_n'))}/sk{_int(f.get(f'{g}_split_k'))}" for g in GEMMS)
                + f"; attn {_int(f.get('attn_block_m'))}x{_int(f.get('attn_block_n'))}"
                + ("" if progs == "0" else f"; {progs} programs"))
    parts = []
    f2 = kernels.get("ffn2")
    ffn2_fuse = _num(f2.get("fuse")) if isinstance(f2, dict) else None  # (FFN1's launch depends on it)
    for g in GEMMS:
        c = kernels.get(g)
        if not isinstance(c, dict):
            continue
        if g == "out" and _num(c.get("fuse")) == 1:  # computed by FFN1's kernel, in front of the block
            parts.append("out in ffn1 (mlp)")
            continue
        if g == "ffn2" and _num(c.get("fuse")) in (1, 2):  # computed by FFN1's kernel where it fits
            parts.append("ffn2 in ffn1 (mlp" + (", 64 a CTA)" if _num(c.get("fuse")) == 2 else ")"))
            continue
        cluster = _num(c.get("cluster"))
        norm_fuse = _num((kernels.get({"qkv": "norm1", "ffn1": "norm2"}.get(g, "")) or {}).get("fuse"))
        if cluster and gemm_kernels(g, cluster, _num(c.get("fuse")), ffn2_fuse, norm_fuse,
                                    _ln_parts(kernels, g, shape)) == ("triton",):
            cluster = 0  # (its launches run the Triton kernels, which read neither field)
        hints = "/l2hints" if _num(c.get("hints")) == 1 and reads_l2_hints(g, cluster, _num(c.get("fuse")),
                                                                              ffn2_fuse) else ""
        if g == "ffn1" and ffn2_fuse in (1, 2):  # the block reads no FFN1 tile
            parts.append("ffn1 (mlp)" + hints)
            continue
        parts.append(f"{g} {_int(c.get('block_m'))}x{_int(c.get('block_n'))}x{_int(c.get('block_k'))}"
                     f"/{_int(c.get('num_warps'))}w{_int(c.get('num_stages'))}s/sk{_int(c.get('split_k', 1))}"
                     + ("/tma" if _num(c.get("tma")) == 1 else "")
                     + {1: "/cluster", 2: "/cluster16"}.get(cluster, "")
                     + hints)
        if g == "qkv" and _num((kernels.get("attn") or {}).get("fuse")) == 1:  # (attention in FFN1's kernel too)
            parts.append("attn in ffn1 (mlp)")
        elif g == "qkv" and _num(c.get("fuse")) == 1:  # (the attention in QKV's kernel)
            parts.append("attn in qkv")
    return "; ".join(parts)


def _markdown_table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    """A pipe table padded so it also reads in a terminal, like the seed's."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else ("-" * (w + 2))
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def _status_counts(run: Run) -> str:
    counts = run.trials["status"].value_counts()
    order = [s for s in STATUSES if s in counts] + sorted(set(counts.index) - set(STATUSES))
    return ", ".join(f"{int(counts[s])} {s}" for s in order)


# ----------------------------------------------------------------------------------------------
# Top-k table
# ----------------------------------------------------------------------------------------------

TOPK_COLUMNS = ["rank", "trial", "latency_us", "spread_us", "speedup", "tie",
                "qkv_op", "out_op", "ffn1_op", "ffn2_op", "tiles", "replayed", "approximated"]


def topk_frame(run: Run) -> pd.DataFrame:
    """One row per re-measured top-k configuration: rank, latency median and spread, speedup over the
    baseline, tie flag, each GEMM's '(o,p)', the compact tiles, then the whole configuration as
    ``<kernel>.<field>`` columns (the same names as trials.csv)."""
    records = []
    for r in run.rows:
        kernels = (r.get("config") or {}).get("kernels") or {}
        rec = {"rank": int(r.get("rank", len(records) + 1)), "trial": r.get("trial"),
               "latency_us": _num(r.get("latency_us")), "spread_us": _num(r.get("spread_us")),
               "speedup": _num(r.get("speedup")), "tie": bool(r.get("tie", False))}
        for g in GEMMS:
            rec[f"{g}_op"] = gemm_op(kernels, g)
        rec["tiles"] = format_tiles(kernels, run.shape)
        rec["replayed"] = run.replayed  # topk.csv read on its own still says its timings were not measured now
        rec["approximated"] = bool(r.get("approximated", False))  # (replayed: served a nearest recorded config's)
        for k in list(KERNELS) + sorted(set(kernels) - set(KERNELS)):
            for field, value in (kernels.get(k) or {}).items():
                rec[f"{k}.{field}"] = value
        records.append(rec)
    df = pd.DataFrame.from_records(records)
    if df.empty:
        return pd.DataFrame(columns=TOPK_COLUMNS)
    return df


def _header_lines(run: Run, k: int) -> list[str]:
    lines = []
    if run.replayed:
        lines += [REPLAYED_LINE, ""]
    lines += [f"Top {k} configurations for {run.shape_name} ({run.dims}, {run.dtype}, {run.gpu_name})", ""]
    facts = []
    spread = f", spread ± {_us(run.baseline_spread_us)} us" if run.baseline_spread_us is not None else ""
    facts.append(f"Baseline latency: {_us(run.baseline_us)} us (all kernels (-1,-1), default tiles){spread}")
    top = run.rows[0] if run.rows else {}
    base, first = _num(run.baseline_us), _num(top.get("latency_us"))
    if base is not None and first is not None and first - base > (_num(run.baseline_spread_us) or 0.0) + (
            _num(top.get("spread_us")) or 0.0):
        # (seen in session 46: a 16-token study whose seeds never entered the space began from random tiles)
        facts.append(f"WARNING: the baseline, the default configuration, is faster than every row below "
                     f"({_us(base)} against {_us(first)} us): the search found nothing that beats it (a short budget, "
                     "or a space without the baseline's tiles); best.json holds the top-1 all the same")
    if run.compile_us is not None or run.eager_us is not None:
        parts = []
        if run.compile_us is not None:
            parts.append(f"torch.compile latency: {_us(run.compile_us)} us (CUDA graph)")
        if run.eager_us is not None:
            parts.append(f"PyTorch eager kernels: {_us(run.eager_us)} us (CUDA graph)")
        facts.append("; ".join(parts))
    ko = run.topk.get("knobs_off")
    if isinstance(ko, dict) and _num(ko.get("latency_us")) is not None:
        slow = _num(ko.get("slowdown"))
        best = run.best
        if slow is None and best and _num(best.get("latency_us")):
            slow = _num(ko["latency_us"]) / _num(best["latency_us"])
        verdict = (f"top-1 is {slow:.2f}x faster" if slow is not None and slow >= 1
                   else f"top-1 is {1 / slow:.2f}x slower" if slow else "no top-1 to compare")
        # the top-1 measured beside the knobs-off twin where the run has it (the figures this line shows), else the
        # table's; a run before top1_spread_us took the table top-1's spread for the paired one's
        top1 = _num(ko.get("top1_latency_us"), (best or {}).get("latency_us"))
        if top1 is not None:
            gap = abs(_num(ko["latency_us"]) - top1)
            within = (_num(ko.get("spread_us")) or 0.0) + (_num(ko.get("top1_spread_us"),
                                                                (best or {}).get("spread_us")) or 0.0)
            if gap <= within:
                verdict += "; within the combined spread: the (o,p) knobs make no measurable difference"
        pair = _num(ko.get("top1_latency_us"))
        beside = (f" against {_us(pair)} us for the top-1 {'served' if run.replayed else 'measured'} beside it"
                  if pair is not None else "")
        facts.append(f"Top-1 with every (o,p) at (-1,-1), tiles kept: {_us(ko['latency_us'])} us{beside} ({verdict})")
    rc = run.topk.get("recheck")
    if isinstance(rc, dict) and isinstance(rc.get("failed"), list):
        n = _num(rc.get("checks"))
        if not n:
            facts.append("Correctness of the top-k not re-checked" + (" (replayed)" if run.replayed else ""))
        else:
            left = "; ".join(f"trial {f.get('trial')} failed ({f.get('reason')}) and is left out"
                             for f in rc["failed"] if isinstance(f, dict))
            facts.append(f"Correctness re-checked {int(n)} more times on fresh input for each top-k configuration: "
                         + (left or "all passed"))
    measured = []
    if run.l2_policy:
        measured.append(f"L2 {run.l2_policy}")
    if run.manifest.get("sampler"):
        measured.append(f"sampler {run.manifest['sampler']}")
    measured.append(f"{len(run.trials)} trials ({_status_counts(run)})" if len(run.trials) else "no trials")
    budget = run.manifest.get("budget") or {}
    if budget.get("timeout_s") and isinstance(budget.get("trials"), int) and len(run.trials) < budget["trials"]:
        measured.append(f"stopped by the {budget['timeout_s']:.0f} s time limit before its {budget['trials']}-trial "
                        "budget")
    n_approx = int(run.trials["approximated"].sum())
    if n_approx:
        measured.append(f"{n_approx} trials approximated by the replay (nearest recorded configuration)")
    facts.append("Run: " + ", ".join(measured))
    remeasure = ((run.manifest.get("policy") or {}).get("final") or {}).get("remeasure") or {}
    groups = remeasure.get("groups")
    if groups and all(remeasure.get("anchored") or [False]):  # (GpuEvaluator.remeasure's anchor, since session 47)
        facts.append(f"Re-measured in groups that fit the GPU's memory ({groups}, one list a re-measurement), one "
                     "group after another, each interleaved with the baseline (the knobs-off twin's with the top-1): "
                     "each speedup is over the baseline's figure from the row's own group")
    elif groups:  # (GpuEvaluator.remeasure: the stacks did not fit the GPU's memory together)
        facts.append(f"Re-measured in groups that fit the GPU's memory ({groups}, one list a re-measurement): rows of "
                     "different groups, the knobs-off pair's too where split, were timed one group after another, "
                     "not interleaved")
    n_rows = sum(bool(r.get("approximated")) for r in run.rows)
    if n_rows:
        facts.append(f"≈: {n_rows} of these rows are configurations the recording does not hold, each served the "
                     "timing of its nearest recorded configuration (not its own)")
    n_via = sum(bool(r.get("via_neighbour")) for r in run.rows)
    if n_via:
        facts.append(f"{n_via} of these rows {'was' if n_via == 1 else 'were'} reached by a trial the recording "
                     "does not hold, served the timing of its nearest recorded configuration: the row shows that "
                     "configuration, which the recording measured")
    if run.l2_policy == "hot":
        facts.append("L2 hot: the weights stay in L2 between layers; a model larger than L2 will not see "
                     "these latencies")
    lines += [f"- {f}" for f in facts]
    return lines


ALIKE_NOTE = "Rows that read alike (the table shows each GEMM's (o,p) and tiles; topk.csv has every field):"


def _field(v) -> str:
    """A configuration field as the tables print it: an integer as such, a ratio with its decimals (1.0, 0.25)."""
    f = _num(v)
    if f is None:
        return str(v)
    return str(float(f)) if isinstance(v, float) else str(int(f)) if f.is_integer() else str(f)


def alike_lines(run: Run, df: pd.DataFrame | None = None, most: int = 4) -> list[str]:
    """For each row of the table that reads as an earlier one (the same (o,p) pairs and tiles, as :func:`topk_frame`
    ``df`` shows them), the fields in which its configuration differs from that row's: a norm's or the attention's
    fields, a GEMM's ``group_m`` (up to ``most``, then how many more). Empty where every row reads apart."""
    df = topk_frame(run) if df is None else df
    first: dict = {}
    out = []
    for r, (_, row) in zip(run.rows, df.iterrows()):  # (topk_frame: one row each, in order)
        kernels = (r.get("config") or {}).get("kernels") or {}
        if not isinstance(kernels, dict):
            continue
        shown = tuple(row[f"{g}_op"] for g in GEMMS) + (row["tiles"],)
        rank = int(row["rank"])
        if shown not in first:
            first[shown] = (rank, kernels)
            continue
        at, other = first[shown]
        diff = []
        for k in list(KERNELS) + sorted((set(kernels) | set(other)) - set(KERNELS)):
            mine, theirs = kernels.get(k) or {}, other.get(k) or {}
            if not isinstance(mine, dict) or not isinstance(theirs, dict):
                continue
            for f in list(mine) + [f for f in theirs if f not in mine]:
                if mine.get(f) != theirs.get(f):
                    diff.append(f"{k}.{f} {_field(mine.get(f))} (rank {at}: {_field(theirs.get(f))})")
        what = ("; ".join(diff[:most]) + (f"; and {len(diff) - most} more" if len(diff) > most else "")
                if diff else "nothing: the same configuration, measured twice")
        out.append(f"- rank {rank} reads as rank {at} and differs in {what}")
    return [ALIKE_NOTE] + out if out else []


def kernel_floors(run: Run) -> dict[str, float]:
    """Each GEMM's share of the floor (the layer's weights read once): its weights' share of the layer's. Empty where
    the run names no floor or no shape."""
    floor = run.floor_us
    if floor is None:
        return {}
    from tuner.shapes import DecoderShape, ShapeError

    try:
        shape = DecoderShape.from_dict(run.shape)
    except (ShapeError, ValueError, TypeError):
        return {}
    return {g: floor * n * k / shape.weight_params for g, (_, n, k) in shape.gemms().items()}


def breakdown_floors(run: Run, df: pd.DataFrame | None = None) -> tuple[dict[str, float], list[str]]:
    """Each kernel's floor in the breakdown of the top-1: the weights it reads (a GEMM's share of the layer's floor,
    plus those of the GEMMs computed inside it), and the kernels computed inside another (their figure is 0, or
    missing beside the one-kernel layer's). Empty without a breakdown. ``df``: the run's :func:`breakdown_data`,
    where the caller has it."""
    df = breakdown_data(run) if df is None else df
    kernels = df[df["kernel"] != "sum"]
    floors = kernel_floors(run)
    inside = [k for k, b in zip(kernels["kernel"], kernels["best_us"]) if b == 0 or math.isnan(b)]
    names = list(kernels["kernel"])
    launched = [k for k in names if k not in inside]
    own = {k: floors[k] for k in launched if k in floors}
    for k in inside:  # a GEMM computed inside another kernel: its weights are that kernel's to read (the next one
        # launched after it, else the one before: the out-projection and FFN2 inside FFN1's feed-forward block)
        if k not in floors:
            continue
        at = names.index(k)
        host = next((n for n in names[at + 1:] if n in launched), None) or next(
            (n for n in reversed(names[:at]) if n in launched), None)
        if host is not None:
            own[host] = own.get(host, 0.0) + floors[k]
    return own, inside


def breakdown_lines(run: Run) -> list[str]:
    """The per-kernel breakdown (breakdown.json) of the top-1 against the baseline and each kernel's floor
    (:func:`breakdown_floors`), as Markdown; empty without one."""
    df = breakdown_data(run)
    if df.empty:
        return []
    own, inside = breakdown_floors(run, df)
    rows = []
    for _, r in df.iterrows():
        k = r["kernel"]
        floor = run.floor_us if k == "sum" else own.get(k)
        best = None if k in inside else r["best_us"]
        rows.append([k, _us(best), _us(r["baseline_us"]), _us(floor),
                     _times(best / floor) if best is not None and floor and not math.isnan(best) else "-"])
    return ["Per-kernel breakdown of the top-1 (each kernel's launches alone in one graph, us a layer; '-': computed "
            "inside another kernel; floor: the weights it reads, those of the GEMMs inside it too, read once at the "
            "measured copy bandwidth). Alone, a kernel pays its whole launch and drain, so the sum is above the "
            "layer's latency:", "",
            _markdown_table(["Kernel", "Top-1(us)", "Baseline(us)", "Floor(us)", "Top-1/floor"], rows,
                            right={1, 2, 3, 4})]


def topk_markdown(run: Run) -> str:
    """The seed's 'Top 10 configurations' table, with spread and tie marks, as Markdown."""
    df = topk_frame(run)
    lines = _header_lines(run, len(df))
    lines.append("")
    headers = ["Rank", "Latency(us)", "±", "Speedup"] + [f"{GEMM_TITLES[g]}(o,p)" for g in GEMMS] + ["tiles"]
    rows = []
    for _, r in df.iterrows():
        marks = ", ".join(m for m, on in (("tie", r["tie"]), ("≈", r["approximated"])) if on)
        rank = f"{int(r['rank'])} ({marks})" if marks else str(int(r["rank"]))
        rows.append([rank, _us(r["latency_us"]), _us(r["spread_us"]), _times(r["speedup"])]
                    + [r[f"{g}_op"] for g in GEMMS] + [r["tiles"]])
    if rows:
        lines.append(_markdown_table(headers, rows, right={0, 1, 2, 3}))
    else:
        lines.append(_markdown_table(headers, [], right={0, 1, 2, 3}))
        lines.append("")
        lines.append("No configuration passed: every trial failed (see the status column of trials.csv).")
    lines += ["", TIES_NOTE, ""]
    for extra in (alike_lines(run, df), breakdown_lines(run)):
        if extra:
            lines += extra + [""]
    return "\n".join(lines)


def write_topk(run: Run) -> list[Path]:
    md, csv = run.path / "topk.md", run.path / "topk.csv"
    write_text_atomic(md, topk_markdown(run))
    write_text_atomic(csv, topk_frame(run).to_csv(index=False))
    return [md, csv]


# ----------------------------------------------------------------------------------------------
# Summary across shapes
# ----------------------------------------------------------------------------------------------

SUMMARY_HEADERS = ["Shape", "Dimensions", "Baseline(us)", "Best(us)", "Speedup", "torch.compile(us)",
                   "vs compile"] + [f"Best_{GEMM_TITLES[g]}" for g in GEMMS]


def summary_frame(runs: list[Run]) -> pd.DataFrame:
    """One row per run: baseline, best, speedup, torch.compile and the best (o,p) of each GEMM.
    ``vs_compile`` = torch.compile latency / best latency (above 1: the tuned layer is faster)."""
    records = []
    for run in runs:
        best = run.best or {}
        kernels = (best.get("config") or {}).get("kernels") or {}
        best_us = _num(best.get("latency_us"))
        speedup = _num(best.get("speedup"))
        if speedup is None and best_us and run.baseline_us:
            speedup = run.baseline_us / best_us
        vs_compile = run.compile_us / best_us if run.compile_us and best_us else None
        rec = {"shape": run.shape_name, "dims": run.dims, "dtype": run.dtype, "gpu": run.gpu_name,
               "replayed": run.replayed, "baseline_us": run.baseline_us, "best_us": best_us,
               "speedup": speedup, "compile_us": run.compile_us, "vs_compile": vs_compile}
        for g in GEMMS:
            rec[f"best_{g}"] = gemm_op(kernels, g)
        records.append(rec)
    return pd.DataFrame.from_records(records)


def summary_markdown(runs: list[Run]) -> str:
    """The seed's 'SUMMARY OF ALL SHAPES' table, in microseconds, with torch.compile beside it."""
    df = summary_frame(runs)
    lines = []
    replayed = [r.shape_name for r in runs if r.replayed]
    if replayed:
        lines += [f"{REPLAYED_LINE}: {', '.join(replayed)}", ""]
    lines += ["SUMMARY OF ALL SHAPES", ""]
    setups = sorted({f"{r.dtype} on {r.gpu_name}" + (f", L2 {r.l2_policy}" if r.l2_policy else "") for r in runs})
    if setups:
        lines += [f"Measured: {'; '.join(setups)}", ""]
    rows = []
    for _, r in df.iterrows():
        rows.append([r["shape"] + (" (replayed)" if r["replayed"] else ""), r["dims"], _us(r["baseline_us"]),
                     _us(r["best_us"]), _times(r["speedup"]), _us(r["compile_us"]), _times(r["vs_compile"])]
                    + [r[f"best_{g}"] for g in GEMMS])
    lines.append(_markdown_table(SUMMARY_HEADERS, rows, right={2, 3, 4, 5, 6}))
    lines += ["", "Speedup: baseline (all kernels (-1,-1), default tiles) / best. "
                  "vs compile: torch.compile latency / best (above 1.00x: the tuned layer is faster).", ""]
    return "\n".join(lines)


def write_summary(runs: list[Run], path) -> Path:
    path = Path(path)
    write_text_atomic(path, summary_markdown(runs))
    return path


# ----------------------------------------------------------------------------------------------
# Plot data (pure) -- the tests check these
# ----------------------------------------------------------------------------------------------

def _ok(run: Run) -> pd.DataFrame:
    t = run.trials
    return t[(t["status"] == "ok") & t["latency_us"].notna()]


def history_data(run: Run) -> pd.DataFrame:
    """Ok trials in trial order: number, latency_us, spread_us, is_baseline, best_us (running best)."""
    ok = _ok(run).sort_values("number")
    df = ok[["number", "latency_us", "spread_us", "is_baseline"]].reset_index(drop=True)
    df["best_us"] = df["latency_us"].cummin()
    return df


def _grid(values: pd.Series) -> pd.Series:
    """Ratios as grid points: -1 stays 'off'; a continuous search space (more than 11 distinct values)
    is binned to 0.1 so the plane stays readable."""
    v = values.astype(float)
    v = v.mask(v < 0, -1.0).round(3)  # NaN (ratio not recorded) stays NaN and is dropped
    if v[v >= 0].nunique() > 11:
        v = v.where(v < 0, v.round(1))
    return v


def trial_pairs(run: Run) -> pd.DataFrame:
    """Long form: number, gemm, overlap_ratio, prefetch_ratio, speedup, a row for each ok trial (with a speedup) and
    GEMM, at the pair that GEMM's launch reads (tuner.layer.launched_config): under the one-kernel layer
    (``layer.fuse`` 1 or 2) every GEMM at the layer's one pair; the out-projection and FFN2 computed in the
    feed-forward block (``out.fuse`` 1, ``ffn2.fuse`` 1 or 2) read no pair of their own, so such a trial has no row
    for them; that block reads of FFN1's overlap ratio only whether it is on (0.0 here). Empty when trials.csv has
    no ratio columns (a device without PDL drops them)."""
    ok = _ok(run)
    ok = ok[ok["speedup"].notna()]

    def switch(name: str) -> pd.Series:
        v = pd.to_numeric(ok[name], errors="coerce") if name in ok.columns else None
        return v.fillna(0) if v is not None else pd.Series(0, index=ok.index)

    fused = switch("layer.fuse").isin((1, 2))
    block = ~fused & switch("ffn2.fuse").isin((1, 2))  # FFN1's launch is the feed-forward block
    unread = {"out": ~fused & (switch("out.fuse") == 1), "ffn2": block}
    parts = []
    for g in GEMMS:
        o, p = f"{g}.overlap_ratio", f"{g}.prefetch_ratio"
        if o not in ok.columns or p not in ok.columns:
            continue
        oo, pp = pd.to_numeric(ok[o], errors="coerce"), pd.to_numeric(ok[p], errors="coerce")
        if "layer.overlap_ratio" in ok.columns and "layer.prefetch_ratio" in ok.columns:
            oo = oo.where(~fused, pd.to_numeric(ok["layer.overlap_ratio"], errors="coerce"))
            pp = pp.where(~fused, pd.to_numeric(ok["layer.prefetch_ratio"], errors="coerce"))
        if g == "ffn1":
            oo = oo.where(~block | (oo < 0) | oo.isna(), 0.0)
        keep = ~unread[g] if g in unread else pd.Series(True, index=ok.index)
        parts.append(pd.DataFrame({"number": ok["number"], "gemm": g, "overlap_ratio": oo, "prefetch_ratio": pp,
                                   "speedup": ok["speedup"].astype(float)})[keep])
    if not parts:
        return pd.DataFrame(columns=["number", "gemm", "overlap_ratio", "prefetch_ratio", "speedup"])
    return pd.concat(parts, ignore_index=True)


def ratio_plane_data(run: Run) -> pd.DataFrame:
    """Long form: gemm, overlap_ratio, prefetch_ratio, median_speedup, n_trials: :func:`trial_pairs` on the plane's
    grid (:func:`_grid`). Empty when trials.csv has no ratio columns."""
    pairs = trial_pairs(run)
    parts = []
    for g, sub in pairs.groupby("gemm", sort=False):
        sub = pd.DataFrame({"overlap_ratio": _grid(sub["overlap_ratio"]),
                            "prefetch_ratio": _grid(sub["prefetch_ratio"]), "speedup": sub["speedup"]}).dropna()
        if sub.empty:
            continue
        agg = (sub.groupby(["overlap_ratio", "prefetch_ratio"])["speedup"]
               .agg(median_speedup="median", n_trials="size").reset_index())
        agg.insert(0, "gemm", g)
        parts.append(agg)
    if not parts:
        return pd.DataFrame(columns=["gemm", "overlap_ratio", "prefetch_ratio", "median_speedup", "n_trials"])
    return pd.concat(parts, ignore_index=True)


def ratio_plane_pivot(data: pd.DataFrame, gemm: str) -> pd.DataFrame:
    """One GEMM's plane: rows prefetch_ratio, columns overlap_ratio, cells median speedup (NaN: not sampled)."""
    sub = data[data["gemm"] == gemm]
    return sub.pivot_table(index="prefetch_ratio", columns="overlap_ratio", values="median_speedup",
                           aggfunc="first").sort_index().sort_index(axis=1)


def importance_data(run: Run) -> pd.DataFrame:
    """param, importance, most important first; empty without importance.json."""
    imp = run.importance or {}
    df = pd.DataFrame({"param": list(imp), "importance": [_num(v) for v in imp.values()]})
    df = df.dropna(subset=["importance"]) if not df.empty else df
    return df.sort_values("importance", ascending=False, kind="stable").reset_index(drop=True)


def breakdown_data(run: Run) -> pd.DataFrame:
    """kernel, best_us, baseline_us: each kernel timed alone, in launch order, then a 'sum' row that the
    floor (the layer's weights read once) is comparable to. Empty without breakdown.json."""
    bd = run.breakdown or {}
    best, base = bd.get("best") or {}, bd.get("baseline") or {}
    names = [k for k in KERNELS if k in best or k in base]
    names += sorted((set(best) | set(base)) - set(KERNELS))
    if not names:
        return pd.DataFrame(columns=["kernel", "best_us", "baseline_us"])
    def figures(d):  # NaN where a kernel has no figure on that side (a bar not drawn)
        return pd.Series([_num(d.get(k)) for k in names], dtype=float)

    df = pd.DataFrame({"kernel": names, "best_us": figures(best), "baseline_us": figures(base)})
    total = pd.DataFrame({"kernel": ["sum"], "best_us": [df["best_us"].sum(min_count=1)],
                          "baseline_us": [df["baseline_us"].sum(min_count=1)]})
    return pd.concat([df, total], ignore_index=True)


def topk_data(run: Run) -> pd.DataFrame:
    """rank, trial, latency_us, spread_us, tie of the re-measured top-k."""
    df = topk_frame(run)
    return df[["rank", "trial", "latency_us", "spread_us", "tie"]].reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# Renderers
# ----------------------------------------------------------------------------------------------
# Figures are built with matplotlib.figure.Figure and the Agg canvas, never pyplot: this is headless
# by construction and does not switch the backend of a notebook that imports this module (a
# module-level matplotlib.use("Agg") would turn its inline plots off).

def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(run: Run, what: str) -> str:
    return f"{what}: {run.shape_name} ({run.dims}, {run.dtype}, {run.gpu_name})" + (
        " (replayed)" if run.replayed else "")


def compact_png(data: bytes) -> bytes:
    """An opaque PNG re-encoded with a 256-colour palette.

    Our plots are flat colours and text on white: the palette changes no cell or label one can read (the median cut
    moves 0.3% of a ratio plane's pixels by more than 8 of 255), and the file is ~2.7x smaller. Every run folder keeps
    five plots and the repository commits ~150 folders. An image with any transparency is returned as it is.
    """
    from PIL import Image  # matplotlib's own dependency

    with Image.open(io.BytesIO(data)) as im:
        if im.mode == "P" or (im.mode == "RGBA" and im.getchannel("A").getextrema()[0] < 255):
            return data
        out = io.BytesIO()
        im.convert("RGB").quantize(256, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)
    return out.getvalue()


def _save(fig, path) -> Path:
    """PNG bytes (compact_png) written to a temporary name and renamed (tuner.manifest.write_bytes_atomic)."""
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    write_bytes_atomic(path, compact_png(buf.getvalue()))
    return path


def _hline(ax, y, label, style, color):
    if y is not None:
        ax.axhline(y, linestyle=style, color=color, linewidth=1.2, label=f"{label} {y:.2f} us")


def plot_history(run: Run, path) -> Path | None:
    df = history_data(run)
    if df.empty:
        return None
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    ax.scatter(df["number"], df["latency_us"], s=14, alpha=0.6, label="ok trial")
    ax.step(df["number"], df["best_us"], where="post", color="C3", label="best so far")
    _hline(ax, run.baseline_us, "baseline", "--", "0.3")
    _hline(ax, run.compile_us, "torch.compile", ":", "C2")
    failed = len(run.trials) - len(df)
    ax.set_xlabel(f"trial number ({failed} failed trials not shown)" if failed else "trial number")
    ax.set_ylabel("latency per layer (us)")
    ax.set_title(_title(run, "Optimization history"), fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_ratio_plane(run: Run, path) -> Path | None:
    data = ratio_plane_data(run)
    if data.empty:
        return None
    from matplotlib import colormaps
    from matplotlib.colors import TwoSlopeNorm

    lo, hi = float(data["median_speedup"].min()), float(data["median_speedup"].max())
    # Centre the colours on 1.0x (no change against the baseline) when the data straddles it.
    norm = TwoSlopeNorm(vcenter=1.0, vmin=lo, vmax=hi) if lo < 1.0 < hi else None
    cmap = colormaps["RdYlGn"].with_extremes(bad="0.92")  # grey: pair not sampled (or only failed)
    fig = _figure(11, 9)
    axes = fig.subplots(2, 2).ravel()
    image = None
    for ax, g in zip(axes, GEMMS):
        piv = ratio_plane_pivot(data, g)
        ax.set_title(f"{GEMM_TITLES[g]} ({g})", fontsize=10)
        if piv.empty:
            ax.text(0.5, 0.5, "no ok trial with its own (o,p)", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
            continue
        vals = piv.to_numpy(dtype=float)
        image = ax.imshow(np.ma.masked_invalid(vals), origin="lower", cmap=cmap, norm=norm,
                          vmin=None if norm else lo, vmax=None if norm else hi, aspect="auto")
        label = lambda v: "off" if v < 0 else _ratio(v)  # noqa: E731
        ax.set_xticks(range(len(piv.columns)), [label(v) for v in piv.columns], fontsize=8)
        ax.set_yticks(range(len(piv.index)), [label(v) for v in piv.index], fontsize=8)
        ax.set_xlabel("overlap_ratio")
        ax.set_ylabel("prefetch_ratio")
        if vals.size <= 64:
            for (i, j), v in np.ndenumerate(vals):
                if np.isfinite(v):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7)
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.8, label="median speedup over baseline (ok trials)")
    fig.suptitle(_title(run, "Speedup over the (overlap, prefetch) plane"), fontsize=10)
    return _save(fig, path)


def plot_importance(run: Run, path) -> Path | None:
    df = importance_data(run)
    if df.empty:
        return None
    df = df.head(25).iloc[::-1]  # most important on top
    fig = _figure(8, max(3.0, 0.3 * len(df) + 1.2))
    ax = fig.add_subplot()
    ax.barh(df["param"], df["importance"], color="C0")
    ax.set_xlabel("importance")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(_title(run, "Parameter importance"), fontsize=10)
    return _save(fig, path)


def plot_breakdown(run: Run, path) -> Path | None:
    df = breakdown_data(run)
    if df.empty:
        return None
    x = np.arange(len(df))
    fig = _figure(9, 4.5)
    ax = fig.add_subplot()
    ax.bar(x - 0.2, df["baseline_us"], width=0.4, label="baseline", color="0.6")
    ax.bar(x + 0.2, df["best_us"], width=0.4, label="best", color="C0")
    _hline(ax, run.floor_us, "floor (layer weights read once)", "--", "C3")
    ax.set_xticks(x, df["kernel"])
    ax.set_ylabel("us per layer (each kernel timed alone)")
    ax.set_title(_title(run, "Per-kernel latency"), fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_topk(run: Run, path) -> Path | None:
    df = topk_data(run)
    if df.empty:
        return None
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    colors = ["C1" if t else "C0" for t in df["tie"]]
    spread = df["spread_us"].fillna(0.0)
    ax.errorbar(df["rank"], df["latency_us"], yerr=spread, fmt="none", ecolor="0.4", capsize=4)
    ax.scatter(df["rank"], df["latency_us"], c=colors, zorder=3)
    # The axis spans the rows (their differences are what the plot is for: on a scale that reaches the baseline,
    # ten rows within 1 us of each other were one flat line); a reference beyond it is named in the legend.
    lo, hi = float((df["latency_us"] - spread).min()), float((df["latency_us"] + spread).max())
    pad = max(0.15 * (hi - lo), 0.01 * hi, 0.02)
    lo, hi = lo - pad, hi + 2 * pad
    ax.set_ylim(lo, hi)
    for x, y in zip(df["rank"], df["latency_us"]):
        ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(6, 0), ha="left", va="center",
                    fontsize=7)
    for y, label, style, color in ((run.baseline_us, "baseline", "--", "0.3"),
                                   (run.compile_us, "torch.compile", ":", "C2")):
        if y is not None and not lo <= y <= hi:  # (an empty line: its entry in the legend, off the axis)
            ax.plot([], [], linestyle=style, color=color, linewidth=1.2,
                    label=f"{label} {y:.2f} us ({'above' if y > hi else 'below'} the axis: "
                          f"{y / float(df['latency_us'].iloc[0]):.2f}x the top-1)")
        else:
            _hline(ax, y, label, style, color)
    ax.set_xticks(df["rank"], [f"{int(r)} (tie)" if t else str(int(r)) for r, t in zip(df["rank"], df["tie"])])
    ax.set_xlabel("rank (tie: within the combined spread of the row above; bars: median ± IQR/2)")
    ax.set_ylabel("latency per layer (us)")
    ax.set_title(_title(run, f"Top {len(df)}"), fontsize=10)
    ax.legend(fontsize=8, loc="upper left")  # (the rows rise to the right)
    return _save(fig, path)


PLOTTERS = {"history": plot_history, "ratio_plane": plot_ratio_plane, "importance": plot_importance,
            "breakdown": plot_breakdown, "topk": plot_topk}


def write_plots(run: Run, skipped: list[str] | None = None) -> list[Path]:
    """plots/<name>.png for every plot the run has data for; returns the files written.

    load_run checks the values each plot reads; a plot that still fails on a damaged file is left out and the others
    are drawn. Each one left out is a line in ``skipped`` or, without that list, a RunFolderError once the rest are
    written. A file that cannot be written (OSError) is raised at once: the next plot would fail the same way."""
    out, failed = [], []
    for name in PLOTS:
        try:
            p = PLOTTERS[name](run, run.path / "plots" / f"{name}.png")
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - one plot's failure must not cost the others (or a study's run folder)
            from tuner.worker import one_line  # (standard library only: no torch here either)

            failed.append(f"plots/{name}.png not drawn ({one_line(e)})")
            continue
        if p is not None:
            out.append(p)
    if skipped is not None:
        skipped.extend(failed)
    elif failed:
        raise RunFolderError(f"{run.path}: {'; '.join(failed)}")
    return out


def write_reports(run_dir, skipped: list[str] | None = None) -> list[Path]:
    """Re-draw a stored run: topk.md, topk.csv and plots/*.png. Returns the paths written; a plot that fails is
    handled as write_plots says."""
    run = load_run(run_dir)
    return write_topk(run) + write_plots(run, skipped)
