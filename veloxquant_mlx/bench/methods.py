"""What a benchmark compares: cache specs, parsed from short names.

A spec names one way to build a model's cache list:
  fp16                    mlx-lm's KVCache (the reference every ratio is taken against)
  mlx-q8, mlx-q4, mlx-q2  mlx-lm's QuantizedKVCache at 8/4/2 bits, group 64 (mlx-lm's default
                          kv_group_size); `mlx-q4:group_size=32` picks another group
  kivi, gear, ...         one of our methods with its defaults; `kivi:bit_width_inlier=4,
                          kivi_group_size=64` sets fields of its KVCacheConfig
Our methods go through `patch_model_kv_cache`, so the attention dispatcher is installed and
attention reads the compressed form, exactly as a user's `generate()` would; the patch is
undone when the spec's context closes, so the next spec sees the plain model.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import yaml

from veloxquant_mlx.errors import QuantizerConfigError

MLX_QUANT_BITS = (2, 3, 4, 5, 6, 8)
MLX_QUANT_GROUPS = (32, 64, 128)
DEFAULT_SPECS = ("fp16", "mlx-q8", "mlx-q4", "mlx-q2")


@dataclass(frozen=True)
class CacheSpec:
    name: str  # as given on the command line; unique within a run
    kind: str  # "fp16", "mlx-quantized" or "ours"
    label: str  # for tables and plot legends
    params: dict = field(default_factory=dict)  # bits/group_size, or the KVCacheConfig dict

    @contextlib.contextmanager
    def open(self, model):
        """Yield `make_cache() -> list`, a fresh cache list per call, for this model."""
        if self.kind == "ours":
            from veloxquant_mlx.config import KVCacheConfig
            from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache

            config = KVCacheConfig.from_dict(self.params)
            patch_model_kv_cache(model, config)
            try:
                yield model.make_cache
            finally:
                unpatch_model_kv_cache(model)
            return
        from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

        if self.kind == "fp16":
            yield lambda: make_prompt_cache(model)
            return

        def make_quantized():
            # Only plain full-attention layers are quantized, as mlx-lm's to_quantized does.
            return [
                QuantizedKVCache(group_size=self.params["group_size"], bits=self.params["bits"])
                if type(c) is KVCache
                else c
                for c in make_prompt_cache(model)
            ]

        yield make_quantized


def _split_params(text: str) -> list[str]:
    # Commas separate fields, except inside a per-layer list like bit_width_inlier=[2,4].
    return [p for p in re.split(r",(?![^\[]*\])", text) if p.strip()]


def _parse_params(name: str, text: str) -> dict:
    params = {}
    for item in _split_params(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise QuantizerConfigError(
                f"cache spec {name!r}: parameter {item!r} is invalid: allowed is field=value"
            )
        params[key.strip()] = yaml.safe_load(value.strip())
    return params


def parse_spec(name: str) -> CacheSpec:
    """'fp16' | 'mlx-q<bits>[:group_size=G]' | '<method>[:field=value,...]' -> CacheSpec."""
    if not isinstance(name, str) or not name.strip():
        raise QuantizerConfigError(f"cache spec {name!r} is invalid: allowed is a non-empty name")
    base, _, rest = name.strip().partition(":")
    params = _parse_params(name, rest) if rest else {}
    if base == "fp16":
        if params:
            raise QuantizerConfigError(f"cache spec {name!r}: fp16 takes no parameters")
        return CacheSpec(name, "fp16", "mlx-lm KVCache (unquantized)")
    match = re.fullmatch(r"mlx-q(\d+)", base)
    if match:
        bits = int(match.group(1))
        group = params.pop("group_size", 64)
        if params:
            raise QuantizerConfigError(
                f"cache spec {name!r}: unknown parameter(s) {sorted(params)}: allowed is group_size"
            )
        if bits not in MLX_QUANT_BITS or group not in MLX_QUANT_GROUPS:
            raise QuantizerConfigError(
                f"cache spec {name!r}: bits={bits} group_size={group!r} is invalid: allowed is "
                f"bits in {MLX_QUANT_BITS} and group_size in {MLX_QUANT_GROUPS}"
            )
        return CacheSpec(
            name, "mlx-quantized", f"mlx-lm QuantizedKVCache {bits}-bit g{group}",
            {"bits": bits, "group_size": group},
        )
    from veloxquant_mlx.config import KVCacheConfig

    config = KVCacheConfig.from_dict({"method": base, **params})  # validates method and fields
    label = base if not params else f"{base} " + " ".join(f"{k}={v}" for k, v in params.items())
    return CacheSpec(name, "ours", label, config.to_dict())


def parse_specs(names) -> list[CacheSpec]:
    return refuse_repeats([parse_spec(n) for n in names])


def refuse_repeats(specs: list) -> list:
    """`specs` as they are, unless a name comes twice (its runs would overwrite each other)."""
    seen = set()
    for spec in specs:
        if spec.name in seen:
            raise QuantizerConfigError(f"cache spec {spec.name!r} is given twice")
        seen.add(spec.name)
    return specs


def with_reference(specs: list[CacheSpec]) -> list[CacheSpec]:
    """Ratios are taken against fp16 in the same run: put it first, adding it if absent."""
    rest = [s for s in specs if s.kind != "fp16"]
    return [parse_spec("fp16"), *rest]
