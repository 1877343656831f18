"""Search spaces: YAML data (search_spaces/*.yaml) read into Optuna distributions, and the one function
that turns a trial's parameters into a DecoderConfig. No torch, no CUDA: tested on any machine."""

from __future__ import annotations

import importlib.resources
from dataclasses import astuple, dataclass, fields, replace
from pathlib import Path

import yaml

from tuner.config import CONFIGS, KIND
from tuner.kernels import attention, gemm, norm
from tuner.kernels.fused_layer import FusedLayerConfig
from tuner.manifest import is_number, why

FAMILY = {"norm1": "norm", "norm2": "norm", "attn": "attn", "qkv": "gemm", "out": "gemm", "ffn1": "gemm",
          "ffn2": "gemm", "layer": "layer"}
TILE_FIELDS = {
    "gemm": ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "split_k", "tma", "cluster",
             "fuse", "hints"),
    "norm": ("rows_per_program", "num_warps", "fuse"),
    "attn": ("block_m", "block_n", "num_warps", "num_stages", "fuse"),
    # The one-kernel layer (tuner.kernels.fused_layer); fuse: 1 replaces the seven kernels above.
    "layer": tuple(f.name for f in fields(FusedLayerConfig) if not f.name.endswith("_ratio")),
}
# Each family's rules for one field alone, whatever the shape (the kernels' ``field_error``, the first rules of their
# check()); the one-kernel layer has none here: its fields' rules depend on which of its two kernels runs.
FIELD_RULES = {"gemm": gemm.field_error, "norm": norm.field_error, "attn": attention.field_error}
# Families a version-1 file may leave out or leave partly out: missing fields take the config's default.
OPTIONAL = {"layer": FusedLayerConfig()}
# Fields whose choices may include 0 (FusedLayerConfig.programs: 0 = one program per SM).
ZERO_OK = ("programs",)
RATIOS = ("overlap_ratio", "prefetch_ratio")
MAX_RATIO_STEPS = 10**6  # a ratio step that makes more steps than this is a mistake (Optuna cannot divide by 5e-324)
# Kernels whose weights can be prefetched (attention has none).
PREFETCHING = ("norm1", "qkv", "out", "norm2", "ffn1", "ffn2", "layer")
# On/off fields: their choices are 0 and 1, not positive sizes (NormConfig.fuse: 0 is the unfused baseline;
# GemmConfig.tma: 0 is cp.async; GemmConfig.cluster: 0 is the Triton kernels; GemmConfig.fuse: 0 is FFN2's and the
# out-projection's own kernel, and QKV's kernel without the attention: only those three have the choice, the gemm
# family's fuse applies to them alone, its 2 to FFN2 alone; AttnConfig.fuse: 0 is the attention kernel, 1 the attention
# in that block; GemmConfig.hints: 0 is the default L2 policy). A file that leaves one out gets [0].
SWITCHES = ("fuse", "tma", "cluster", "hints")
# The norms' switch has a third state: 2 takes the row statistics from the GEMM that produced the rows; so has the
# GEMMs' cluster switch: 2 exchanges the split-K partials in 16 bits; and FFN2's fuse: 2 runs the one-kernel
# feed-forward block with 64 hidden columns a CTA. Keys: a family, or (family, field).
SWITCH_VALUES = {"norm": (0, 1, 2), "layer": (0, 1, 2), ("gemm", "cluster"): (0, 1, 2),
                 ("gemm", "fuse"): (0, 1, 2)}


class SpaceError(ValueError):
    """A malformed search space: the message names the file, the key and what was expected."""


@dataclass(frozen=True)
class Dim:
    """One searchable parameter: categorical choices, or a float range (low, high, step|None, off)."""

    choices: tuple | None = None
    low: float | None = None
    high: float | None = None
    step: float | None = None
    off: bool = False

    def distribution(self):
        import optuna.distributions as d

        if self.choices is not None:
            return d.CategoricalDistribution(list(self.choices))
        return d.FloatDistribution(self.low, self.high, step=self.step)


@dataclass(frozen=True)
class SearchSpace:
    source: str
    dims: dict  # kernel -> {field: Dim}

    def contains(self, params: dict, pdl: bool = True) -> bool:
        """Whether fixed ``kernel.field`` values (a seed config) lie inside this space."""
        for name, dim in self.params(pdl).items():
            v = params.get(name)
            if v is None:
                return False
            if dim.choices is not None:
                if v not in dim.choices:
                    return False
            elif not (dim.low <= v <= dim.high or (dim.off and v < 0)):
                return False
        return True

    def fingerprint(self) -> str:
        """What the space holds, as 12 hex digits (not where it was read from): a study's identity, since a study
        cannot change its parameters' distributions."""
        import hashlib

        text = repr(sorted((k, astuple(d)) for k, d in self.params(True).items()))
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def params(self, pdl: bool = True) -> dict[str, Dim]:
        """Flat ``kernel.field`` -> Dim; the ratios vanish where PDL/prefetch cannot run."""
        out = {}
        for k in CONFIGS:
            for f, dim in self.dims[k].items():
                if f in RATIOS and not pdl:
                    continue
                out[f"{k}.{f}"] = dim
        return out


def _dim(where: str, value, ratio: bool, switch: tuple | None = None, zero: bool = False) -> Dim:
    if isinstance(value, list):
        if not value:
            raise SpaceError(f"{where}: expected a non-empty list of choices")
        for v in value:
            if not is_number(v):
                raise SpaceError(f"{where}: choice {v!r} is not a finite number")
            if ratio and not (v < 0 or 0 <= v <= 1):
                raise SpaceError(f"{where}: ratio {v} must be negative (off) or in [0, 1]")
            if switch and v not in switch:
                on = "1 (on)" if switch == (0, 1) else " or ".join(str(x) for x in switch[1:])
                raise SpaceError(f"{where}: choice {v!r} must be 0 (off) or {on}")
            if not ratio and not switch and (not isinstance(v, int) or v < (0 if zero else 1)):
                raise SpaceError(f"{where}: choice {v!r} must be a {'non-negative' if zero else 'positive'} integer")
        return Dim(choices=tuple(float(v) if ratio else int(v) for v in value))
    if isinstance(value, dict) and ratio:
        # YAML 1.1 (PyYAML) reads a bare `off:` key as the boolean false
        value = {("off" if k is False else k): v for k, v in value.items()}
        unknown = set(value) - {"low", "high", "step", "off"}
        if unknown or "low" not in value or "high" not in value:
            raise SpaceError(f"{where}: expected {{low, high[, step][, off]}}, got keys {_names(value)}")
        lo, hi = value["low"], value["high"]
        if not all(is_number(v) for v in (lo, hi)) or not 0 <= lo < hi <= 1:
            raise SpaceError(f"{where}: need 0 <= low < high <= 1, got low={lo!r} high={hi!r}")
        step, off = value.get("step"), value.get("off", False)
        if step is not None and (not is_number(step) or not 0 < step <= hi - lo):
            raise SpaceError(f"{where}.step: need 0 < step <= high - low, got {step!r}")
        steps = None if step is None else (hi - lo) / step
        if steps is not None and not steps <= MAX_RATIO_STEPS:  # (a float too small to divide by, too)
            raise SpaceError(f"{where}.step: {step!r} makes more than {MAX_RATIO_STEPS:,} steps; give a larger one")
        if steps is not None and abs(steps - round(steps)) > 1e-9:
            # (Optuna would move high down to the last step, and warn so at every trial)
            raise SpaceError(f"{where}.step: {step!r} must divide high - low = {hi - lo:g}")
        if not isinstance(off, bool):
            raise SpaceError(f"{where}.off: expected true or false, got {off!r}")
        return Dim(low=float(lo), high=float(hi), step=None if step is None else float(step), off=off)
    expect = ("a list of ratios or {low, high}" if ratio else "a list of 0 and/or 1" if switch
              else "a list of positive integers")
    raise SpaceError(f"{where}: expected {expect}, got {type(value).__name__}")


def _names(keys) -> list[str]:
    """Keys as a sorted list for a message (a user's YAML may mix strings, numbers and booleans)."""
    return sorted(map(str, keys))


def parse(data, source: str = "<space>") -> SearchSpace:
    if not isinstance(data, dict):
        raise SpaceError(f"{source}: expected a mapping at the top level")
    known = {"version", "ratios", "gemm", "norm", "attn", "layer", "kernels"}
    unknown = set(data) - known
    if unknown:
        raise SpaceError(f"{source}: unknown key(s) {_names(unknown)}; expected {sorted(known)}")
    if data.get("version", 1) != 1 or isinstance(data.get("version"), bool):  # (true == 1 in Python)
        raise SpaceError(f"{source}: version {data.get('version')!r} is not supported (expected 1)")
    ratios = {} if data.get("ratios") is None else data["ratios"]  # (absent: no ratio searched, every kernel off)
    if not isinstance(ratios, dict) or set(ratios) - {"overlap", "prefetch"}:
        raise SpaceError(f"{source}: 'ratios' must be a mapping with 'overlap' and/or 'prefetch'")
    base_ratio = {"overlap_ratio": ratios.get("overlap", [-1.0]), "prefetch_ratio": ratios.get("prefetch", [-1.0])}
    fam_data = {}
    for fam, names in TILE_FIELDS.items():
        sec = data.get(fam)
        if fam in OPTIONAL and sec is None:
            sec = {}
        if not isinstance(sec, dict):
            raise SpaceError(f"{source}: '{fam}' must be a mapping of {', '.join(names)}")
        unknown = set(sec) - set(names)
        if unknown:
            raise SpaceError(f"{source}: {fam}: unknown key(s) {_names(unknown)}; expected {list(names)}")
        # Switches added after version 1 shipped default to off, so older user files keep working.
        sec = {**{f: [0] for f in SWITCHES if f in names}, **sec}
        if fam in OPTIONAL:
            sec = {**{f: [getattr(OPTIONAL[fam], f)] for f in names}, **sec}
        missing = set(names) - set(sec)
        if missing:
            raise SpaceError(f"{source}: {fam}: missing key(s) {_names(missing)}")
        fam_data[fam] = sec
    overrides = {} if data.get("kernels") is None else data["kernels"]
    if not isinstance(overrides, dict):
        raise SpaceError(f"{source}: 'kernels' must map kernel names to overrides")
    for k in overrides:
        if k not in CONFIGS:
            raise SpaceError(f"{source}: kernels: unknown kernel {k!r}; expected one of {list(CONFIGS)}")
    dims = {}
    for k in CONFIGS:
        fam = FAMILY[k]
        raw = dict(fam_data[fam])
        raw.update(base_ratio)
        if k not in PREFETCHING:
            raw["prefetch_ratio"] = [-1.0]
        ov = {} if overrides.get(k) is None else overrides[k]
        if not isinstance(ov, dict):
            raise SpaceError(f"{source}: kernels.{k}: expected a mapping")
        allowed = set(TILE_FIELDS[fam]) | set(RATIOS)
        for f, v in ov.items():
            if f not in allowed:
                raise SpaceError(f"{source}: kernels.{k}.{f}: unknown key; expected one of {sorted(allowed)}")
            if k not in PREFETCHING and f == "prefetch_ratio":
                raise SpaceError(f"{source}: kernels.{k}.prefetch_ratio: attention has no weights to prefetch")
            raw[f] = v
        if fam == "gemm" and k == "ffn1":  # fuse is FFN2's, the out-projection's (FFN1's kernel) and QKV's
            if not isinstance(ov.get("fuse", [0]), list) or any(v != 0 for v in (ov.get("fuse") or [0])):
                raise SpaceError(f"{source}: kernels.ffn1.fuse: only ffn2, out and qkv can be fused; expected [0]")
            raw["fuse"] = [0]
        if k in ("out", "qkv") and isinstance(raw.get("fuse"), list):  # 0 or 1: 2 is FFN2's (64 hidden columns a CTA)
            if "fuse" in ov and any(v not in (0, 1) for v in ov["fuse"]):
                raise SpaceError(f"{source}: kernels.{k}.fuse: expected a list of 0 and 1, got {ov['fuse']!r}")
            raw["fuse"] = [v for v in raw["fuse"] if v in (0, 1)] or [0]
        dims[k] = {}
        for f, v in raw.items():
            # Errors name the key as the YAML spells it: kernels.qkv.block_m, gemm.block_m, ratios.overlap.
            where = f"{source}: " + (f"kernels.{k}.{f}" if f in ov else f"{fam}.{f}" if f not in RATIOS
                                     else f"ratios.{f.removesuffix('_ratio')}")
            dims[k][f] = _dim(where, v, f in RATIOS, SWITCH_VALUES.get((fam, f), SWITCH_VALUES.get(fam, (0, 1)))
                              if f in SWITCHES else None, f in ZERO_OK)
            _check_choices(where, k, f, dims[k][f])
    return SearchSpace(source, dims)


def _check_choices(where: str, kernel: str, field: str, dim: Dim) -> None:
    """Refuse a tile choice that no problem and no GPU can run (``num_warps: [3]``, ``block_m: [48]``): every trial
    that drew it would be invalid."""
    rule = FIELD_RULES.get(FAMILY[kernel])
    if rule is None or dim.choices is None or field in RATIOS or field in SWITCHES:
        return
    for v in dim.choices:
        error = rule(replace(KIND[kernel](), **{field: v}))
        if error:
            raise SpaceError(f"{where}: choice {v} can never run ({error})")


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently: a second
    ``gemm:`` section replaced the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"found duplicate key {key!r}",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader


def read_yaml(path: str | Path, what: str, error=ValueError):
    """A user's YAML file, or ``error`` with one line naming the file (and the line of a syntax error)."""
    p = Path(path)
    if p.is_dir():
        raise error(f"{path}: a folder, not a {what} file")
    if not p.is_file():
        hint = f" (shipped: {', '.join(shipped())})" if what == "search space" else ""
        raise error(f"{path}: {what} file not found{hint}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read the {what} file ({why(e)})") from None
    try:
        return _load_yaml(text)
    except RecursionError:
        raise error(f"{path}: not valid YAML here (nested too deeply)") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise error(f"{path}: not valid YAML{at} ({str(e).splitlines()[0]})") from None


def shipped() -> list[str]:
    """The search spaces installed with tuner (package data), by name: decoder (the default), fused-layer, ..."""
    files = importlib.resources.files("tuner.search_spaces").iterdir()
    return sorted(f.name.removesuffix(".yaml") for f in files if f.name.endswith(".yaml"))


def load(path: str | Path | None = None) -> SearchSpace:
    """The shipped default (package data of tuner), a user's YAML file, or a shipped space by name (``fused-layer``
    or ``fused-layer.yaml``, where no such file is in the working folder)."""
    if path is None:
        path = "decoder"
    name = str(path).removesuffix(".yaml")
    if not Path(path).is_file() and "/" not in str(path) and name in shipped():
        text = importlib.resources.files("tuner.search_spaces").joinpath(f"{name}.yaml").read_text()
        return parse(_load_yaml(text), f"{name}.yaml (shipped)" if name != "decoder" else "decoder.yaml (default)")
    return parse(read_yaml(path, "search space", SpaceError), str(path))


def to_config(params: dict, space_pdl: bool = True):
    """Flat ``kernel.field`` parameters -> DecoderConfig (missing ratios are -1: off)."""
    from tuner.config import DecoderConfig

    per = {k: {} for k in CONFIGS}
    for key, v in params.items():
        k, f = key.split(".", 1)
        per[k][f] = v
    kw = {}
    for k in CONFIGS:
        cls = KIND[k]
        names = {f.name for f in fields(cls)}
        d = {f: v for f, v in per[k].items() if f in names}
        kw[k] = cls.from_dict(d)
    return DecoderConfig(**kw)


def trial_params(raw: dict) -> dict:
    """A trial's Optuna parameters as :func:`suggest` returned them: a ratio switched off (``name.on`` False) is -1."""
    out = {}
    for key, v in raw.items():
        if key.endswith(".on"):
            if not v:
                out[key[:-3]] = -1.0
        else:
            out[key] = v
    return out


def from_config(cfg, pdl: bool = True) -> dict:
    """DecoderConfig -> flat parameters (for enqueueing the baseline and seeds)."""
    out = {}
    for k, c in cfg.kernels():
        for f, v in c.to_dict().items():
            if f in RATIOS and not pdl:
                continue
            out[f"{k}.{f}"] = v
    return out


def suggest(trial, space: SearchSpace, pdl: bool = True) -> dict:
    """Ask ``trial`` for every parameter; continuous ratios with ``off`` get a boolean switch."""
    params = {}
    for name, dim in space.params(pdl).items():
        if dim.choices is not None:
            params[name] = trial.suggest_categorical(name, list(dim.choices))
        else:
            if dim.off and not trial.suggest_categorical(name + ".on", [True, False]):
                params[name] = -1.0
                continue
            params[name] = trial.suggest_float(name, dim.low, dim.high, step=dim.step)
    return params
