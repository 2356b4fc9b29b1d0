"""Cache specs for the measurement modules: the names `veloxquant bench` takes (methods.py:
fp16, mlx-q4[:group_size=G], our methods with fields) plus the code ablations (ablations.py),
buildable one layer at a time without a model, or for a whole model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from veloxquant_mlx.bench.ablations import ABLATIONS, Marked
from veloxquant_mlx.bench.methods import CacheSpec, _parse_params, parse_spec, refuse_repeats
from veloxquant_mlx.errors import QuantizerConfigError


@dataclass(frozen=True)
class LayerSpec:
    name: str  # as given on the command line
    kind: str  # "fp16", "mlx-quantized", "ours" or "ablation"
    label: str
    params: dict = field(default_factory=dict)  # bits/group_size, or the KVCacheConfig dict
    ablation: str | None = None  # key of ABLATIONS for kind "ablation"

    def _config(self):
        from veloxquant_mlx.config import KVCacheConfig

        return KVCacheConfig.from_dict(self.params)

    def make(self, layer_index: int = 0, n_layers: int = 1):
        """A fresh cache for attention layer `layer_index` of `n_layers`."""
        if self.kind == "fp16":
            from mlx_lm.models.cache import KVCache

            return KVCache()
        if self.kind == "mlx-quantized":
            from mlx_lm.models.cache import QuantizedKVCache

            return QuantizedKVCache(group_size=self.params["group_size"], bits=self.params["bits"])
        if self.kind == "ablation":
            build = ABLATIONS[self.ablation][0]
            return build(self._config(), layer_index, n_layers)
        from veloxquant_mlx.cache.factory import KVCacheFactory

        return KVCacheFactory.create(self._config(), layer_index, n_layers)

    @contextlib.contextmanager
    def open(self, model):
        """Yield `make_cache() -> list` for `model`, our attention dispatcher installed for
        ours and ablations (as a user's patched model has it), undone on exit."""
        if self.kind != "ablation":
            with CacheSpec(self.name, self.kind, self.label, self.params).open(model) as make_cache:
                yield make_cache
            return
        build = ABLATIONS[self.ablation][0]
        if isinstance(build, Marked):
            # The patch's own lists (a cross-layer method's layers share a coordinator), marked.
            with CacheSpec(self.name, "ours", self.label, self.params).open(model) as make_cache:
                yield lambda: build.mark(make_cache())
            return
        from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache

        # The patch installs the dispatcher; the ablation's caches replace what it would build.
        patch_model_kv_cache(model, self._config())
        n_layers = len(model.layers)
        try:
            yield lambda: [self.make(i, n_layers) for i in range(n_layers)]
        finally:
            unpatch_model_kv_cache(model)


def parse_layer_spec(name: str) -> LayerSpec:
    try:
        return _parse_layer_spec(name)
    except QuantizerConfigError as exc:
        if repr(name) in str(exc):
            raise
        raise QuantizerConfigError(f"cache spec {name!r}: {exc}") from None


def _parse_layer_spec(name: str) -> LayerSpec:
    base, _, rest = name.strip().partition(":")
    if base in ABLATIONS:
        from veloxquant_mlx.config import KVCacheConfig

        _, method, label = ABLATIONS[base]
        params = _parse_params(name, rest) if rest else {}
        config = KVCacheConfig.from_dict({"method": method, **params})  # validates the fields
        if params:
            label += " " + " ".join(f"{k}={v}" for k, v in params.items())
        return LayerSpec(name, "ablation", label, config.to_dict(), base)
    spec = parse_spec(name)
    return LayerSpec(spec.name, spec.kind, spec.label, spec.params)


def parse_layer_specs(text: str, default: list[str]) -> list[LayerSpec]:
    """Specs from a --methods text (comma list; 'default' expands to `default`)."""
    from veloxquant_mlx.cli.bench import resolve_methods

    specs = refuse_repeats([parse_layer_spec(n) for n in resolve_methods(text, default=default)])
    if not specs:
        raise QuantizerConfigError(f"--methods {text!r} names no cache spec")
    return specs


def describe(specs: list[LayerSpec]) -> list[dict]:
    return [{"name": s.name, "label": s.label, "kind": s.kind, "params": s.params} for s in specs]
