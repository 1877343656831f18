"""One config per kernel of the decoder layer, with a versioned JSON form."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tuner.kernels.attention import AttnConfig
from tuner.kernels.fused_layer import FusedLayerConfig
from tuner.kernels.gemm import GemmConfig
from tuner.kernels.norm import NormConfig
from tuner.names import GEMMS, KERNELS  # noqa: F401 - launch order inside one layer, and its GEMMs (torch-free)

SCHEMA_VERSION = 1
KIND = {"norm1": NormConfig, "qkv": GemmConfig, "attn": AttnConfig, "out": GemmConfig,
        "norm2": NormConfig, "ffn1": GemmConfig, "ffn2": GemmConfig, "layer": FusedLayerConfig}
# The seven kernels, then the one-kernel layer (``layer.fuse``: when 1, it replaces all seven).
CONFIGS = KERNELS + ("layer",)


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class DecoderConfig:
    norm1: NormConfig = NormConfig()
    qkv: GemmConfig = GemmConfig()
    attn: AttnConfig = AttnConfig()
    out: GemmConfig = GemmConfig()
    norm2: NormConfig = NormConfig()
    ffn1: GemmConfig = GemmConfig()
    ffn2: GemmConfig = GemmConfig()
    layer: FusedLayerConfig = FusedLayerConfig()

    @property
    def fused(self) -> bool:
        """The whole layer runs as one persistent kernel (tuner.kernels.fused_layer)."""
        return bool(self.layer.fuse)

    def kernels(self):
        """(name, config) of the seven per-kernel configs and the one-kernel layer's."""
        return [(name, getattr(self, name)) for name in CONFIGS]

    def without_knobs(self) -> "DecoderConfig":
        """Same tiles, every (overlap, prefetch) pair at (-1, -1): the seed's 'all mm: -1.0'."""
        return replace(self, **{n: c.without_knobs() for n, c in self.kernels()})

    def with_knobs(self, overlap_ratio: float, prefetch_ratio: float) -> "DecoderConfig":
        """Every kernel at the same pair (attention never prefetches: it has no weights)."""
        out = {}
        for n, c in self.kernels():
            p = -1.0 if isinstance(c, AttnConfig) else prefetch_ratio  # attention has no weights
            out[n] = replace(c, overlap_ratio=overlap_ratio, prefetch_ratio=p)
        return replace(self, **out)

    def edited(self, edits) -> "DecoderConfig":
        """This config with ``kernel.field=value`` edits (e.g. ``out.split_k=4``, ``ffn2.prefetch_ratio=0.6``):
        the diagnostics scripts' variants. A value with a dot is a float, else an int."""
        cfg = self
        for e in edits:
            key, v = e.split("=")
            k, f = key.split(".")
            c = getattr(cfg, k)
            cfg = replace(cfg, **{k: replace(c, **{f: type(getattr(c, f))(float(v) if "." in v else int(v))})})
        return cfg

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, "kernels": {n: c.to_dict() for n, c in self.kernels()}}

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        v = d.get("schema_version")
        if v != SCHEMA_VERSION:
            raise ConfigError(f"config schema_version {v!r} is not supported (this tune reads {SCHEMA_VERSION})")
        ks = d.get("kernels")
        if not isinstance(ks, dict):
            raise ConfigError("config has no 'kernels' mapping")
        unknown = set(ks) - set(CONFIGS)
        if unknown:
            raise ConfigError(f"config names unknown kernels {sorted(unknown)}; expected {list(CONFIGS)}")
        for n in CONFIGS:
            if n in ks and not isinstance(ks[n], dict):
                raise ConfigError(f"config: {n} must be a mapping of its fields, not {type(ks[n]).__name__}")
        try:
            return cls(**{n: KIND[n].from_dict(ks[n]) for n in CONFIGS if n in ks})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"config: {e}") from None


assert tuple(f.name for f in fields(DecoderConfig)) == CONFIGS
