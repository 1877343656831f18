"""Decoder-layer shapes: the seed's presets and ``BxSxDxHxF`` custom shapes."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from tuner.manifest import is_int

# Head dims the attention kernel supports (padded to a power of two inside it).
HEAD_DIM_RANGE = (32, 128)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
# The kernels index their tensors with 32-bit offsets (as in Triton's tutorials): no tensor they index, a split-K
# workspace included (kernels/gemm.py), may hold this many elements.
OFFSET_LIMIT = 2**31


class ShapeError(ValueError):
    """A user-facing shape problem; the message is one line and lists the valid choices."""


@dataclass(frozen=True)
class DecoderShape:
    batch: int
    seq: int
    d_model: int
    heads: int
    ffn: int
    name: str = ""
    # The model's own depth: the stack replayed back to back under `--l2 hot`.
    depth: int = 12
    # Kept open for later variants (RMSNorm, SwiGLU, grouped-query attention); only these run today.
    norm: str = "layernorm"
    activation: str = "gelu"

    def __post_init__(self):
        for f in ("batch", "seq", "d_model", "heads", "ffn", "depth"):
            v = getattr(self, f)
            if not is_int(v) or v <= 0:
                raise ShapeError(f"shape {self.spec}: {f}={v!r} must be a positive integer")
        # The name is a folder of the run (<out>/<name>/<run-id>): one path component, nothing that climbs out.
        if not isinstance(self.name, str) or (self.name and not NAME.fullmatch(self.name)):
            raise ShapeError(f"shape {self.spec}: name {self.name!r} must be letters, digits, '.', '_', '+' or '-', "
                             "starting with a letter or digit")
        if self.d_model % self.heads:
            raise ShapeError(f"shape {self.spec}: d_model={self.d_model} is not divisible by heads={self.heads}")
        lo, hi = HEAD_DIM_RANGE
        if not lo <= self.head_dim <= hi:
            raise ShapeError(f"shape {self.spec}: head dim {self.head_dim} (d_model/heads) must be in {lo}..{hi}")
        widest = self.tokens * max(3 * self.d_model, self.ffn)
        if widest >= OFFSET_LIMIT:
            raise ShapeError(f"shape {self.spec}: its widest activation, tokens*max(3*d_model, ffn) = {widest} "
                             f"elements, is past the 32-bit offsets the kernels index with (< {OFFSET_LIMIT})")
        weight = self.d_model * max(3 * self.d_model, self.ffn)
        if weight >= OFFSET_LIMIT:
            raise ShapeError(f"shape {self.spec}: its largest weight, d_model*max(3*d_model, ffn) = {weight} elements, "
                             f"is past the 32-bit offsets the kernels index with (< {OFFSET_LIMIT})")
        if self.norm != "layernorm" or self.activation != "gelu":
            raise ShapeError(f"shape {self.spec}: only layernorm + gelu layers are implemented")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def spec(self) -> str:
        return f"{self.batch}x{self.seq}x{self.d_model}x{self.heads}x{self.ffn}"

    @property
    def label(self) -> str:
        return self.name or self.spec

    @property
    def weight_params(self) -> int:
        d, f = self.d_model, self.ffn
        return (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        return self.weight_params * dtype_bytes

    def gemms(self) -> dict[str, tuple[int, int, int]]:
        """(M, N, K) of each GEMM of the layer."""
        m, d, f = self.tokens, self.d_model, self.ffn
        return {"qkv": (m, 3 * d, d), "out": (m, d, d), "ffn1": (m, f, d), "ffn2": (m, d, f)}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderShape":
        if not isinstance(d, dict):
            raise ShapeError(f"a shape must be a mapping of batch, seq, d_model, heads, ffn, not {type(d).__name__}")
        why = keys_error(d)
        if why:
            raise ShapeError(f"shape {d}: {why}")
        return cls(**d)


def keys_error(d: dict) -> str | None:
    """Why a mapping's keys are not a shape's (a required one missing, or one a shape does not have); None if they
    are."""
    from dataclasses import MISSING, fields

    names = [f.name for f in fields(DecoderShape)]
    required = [f.name for f in fields(DecoderShape) if f.default is MISSING]
    missing = [k for k in required if k not in d]
    unknown = [str(k) for k in d if k not in names]
    if missing:
        return f"missing {', '.join(missing)} (a shape needs {', '.join(required)})"
    if unknown:
        return f"unknown key {', '.join(unknown)} (a shape takes {', '.join(names)})"
    return None


PRESETS: dict[str, DecoderShape] = {
    "tiny": DecoderShape(1, 32, 256, 4, 1024, name="tiny", depth=4),
    "bert-base": DecoderShape(1, 128, 768, 12, 3072, name="bert-base", depth=12),
    "bert-large": DecoderShape(1, 128, 1024, 16, 4096, name="bert-large", depth=24),
}


def parse_spec(text: str) -> DecoderShape:
    parts = text.lower().split("x")
    if len(parts) != 5:
        raise ShapeError(f"shape {text!r}: expected a preset ({', '.join(PRESETS)}) or BxSxDxHxF, "
                         "e.g. 1x128x768x12x3072")
    parts = [p.strip() for p in parts]
    if not all(re.fullmatch(r"-?[0-9]+", p) for p in parts):  # (not int()'s "1_28" or "+128")
        raise ShapeError(f"shape {text!r}: BxSxDxHxF needs five integers, e.g. 1x128x768x12x3072")
    b, s, d, h, f = (int(p) for p in parts)
    return DecoderShape(b, s, d, h, f)


def resolve(text: str, *, also: tuple[str, ...] = ()) -> DecoderShape:
    """A preset name or a ``BxSxDxHxF`` spec; ShapeError lists the presets otherwise, and ``also``: other names the
    caller takes (the command line's 'all')."""
    if not isinstance(text, str):
        raise ShapeError(f"shape: expected a preset name ({', '.join(PRESETS)}) or 'BxSxDxHxF' text, "
                         f"not {type(text).__name__}")
    key = text.strip().lower()
    if key in PRESETS:
        return PRESETS[key]
    if "x" in key and (key[:1].isdigit() or key[:1] == "-"):  # (-1x...: its own message, a positive integer)
        return parse_spec(key)
    names = ", ".join([*PRESETS, *(repr(a) for a in also)])
    raise ShapeError(f"unknown shape {text!r}: choose one of {names}, or BxSxDxHxF")
