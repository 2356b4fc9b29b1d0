"""KVCacheConfig: a method and its parameters, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, fields as dataclass_fields

from veloxquant_mlx.config.fields import FIELDS, METHOD_RANGES, METHODS, fields_of
from veloxquant_mlx.errors import QuantizerConfigError


def _check_value(method: str, name: str, value):
    """Validate one field's value for a method; return it normalised (lists become tuples)."""
    spec = FIELDS[name]
    check, allowed = METHOD_RANGES.get((method, name), (spec.check, spec.allowed))
    if spec.per_layer and isinstance(value, (list, tuple)):
        if not value:
            raise QuantizerConfigError(
                f"KVCacheConfig.{name}=[] is invalid for {method}: a per-layer list needs one "
                "entry per attention layer"
            )
        for index, item in enumerate(value):
            if not check(item):
                raise QuantizerConfigError(
                    f"KVCacheConfig.{name}[{index}]={item!r} is invalid for {method}: "
                    f"allowed is {allowed}"
                )
        return tuple(value)
    if spec.defaults.get(method, 0) is None and value is None:
        return None
    if not check(value):
        raise QuantizerConfigError(
            f"KVCacheConfig.{name}={value!r} is invalid for {method}: allowed is {allowed}"
        )
    return value


@dataclass(frozen=True)
class KVCacheConfig:
    """Which compressed cache to build, with its parameters.

    Every parameter defaults to None, meaning "the method's default"; after construction each
    field the method owns holds its effective value and every other field is None. Setting a
    field the chosen method does not own is an error, never silently ignored.
    """

    method: str = "turboquant_rvq"
    bit_width_inlier: int | tuple[int, ...] | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    seed: int | None = None
    kivi_group_size: int | None = None
    kivi_residual_length: int | None = None
    kvquant_bits: int | None = None
    kvquant_outlier_fraction: float | None = None
    kvquant_group_size: int | None = None
    gear_bits: int | None = None
    gear_group_size: int | None = None
    gear_rank: int | None = None
    gear_outlier_fraction: float | None = None
    xquant_group_size: int | None = None
    xquant_residual_length: int | None = None
    xquant_eta: float | None = None
    xquant_share_from: float | None = None
    minicache_start_fraction: float | None = None
    minicache_threshold: float | None = None
    minicache_bits: int | None = None
    minicache_retain_slots: int | None = None
    minicache_residual_length: int | None = None
    pyramidkv_budget: int | None = None
    pyramidkv_window: int | None = None
    pyramidkv_beta: int | None = None
    pyramidkv_kernel: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantizerConfigError(
                f"KVCacheConfig.method={self.method!r} is unknown: allowed is one of {METHODS}"
            )
        own = fields_of(self.method)
        for name in FIELDS:
            value = getattr(self, name)
            if name not in own:
                if value is not None:
                    owners = tuple(FIELDS[name].defaults)
                    raise QuantizerConfigError(
                        f"KVCacheConfig.{name}={value!r} does not apply to method "
                        f"{self.method!r}: it belongs to {owners}; the fields of "
                        f"{self.method!r} are {own}"
                    )
                continue
            if value is None:
                value = FIELDS[name].defaults[self.method]
            object.__setattr__(self, name, _check_value(self.method, name, value))

    def own_fields(self) -> tuple[str, ...]:
        return fields_of(self.method)

    def bits_for_layer(self, layer_index: int, n_layers: int | None = None) -> int:
        """bit_width_inlier for one attention layer (a per-layer list is indexed)."""
        bits = self.bit_width_inlier
        if isinstance(bits, tuple):
            if n_layers is not None and len(bits) != n_layers:
                raise QuantizerConfigError(
                    f"KVCacheConfig.bit_width_inlier has {len(bits)} entries but the model has "
                    f"{n_layers} attention layers: allowed is one entry per attention layer"
                )
            return bits[layer_index]
        return bits

    def to_dict(self) -> dict:
        """JSON-safe: the method and the fields it owns (tuples as lists)."""
        out: dict = {"method": self.method}
        for name in self.own_fields():
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "KVCacheConfig":
        if not isinstance(data, dict):
            raise QuantizerConfigError(
                f"KVCacheConfig.from_dict needs a mapping, got {type(data).__name__}"
            )
        known = {f.name for f in dataclass_fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise QuantizerConfigError(
                f"KVCacheConfig.from_dict: unknown field(s) {unknown}: allowed are {sorted(known)}"
            )
        return cls(**data)
