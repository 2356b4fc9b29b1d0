"""mlx-lm's save_prompt_cache -> load_prompt_cache with every cross-layer cache.

mlx-lm's loader looks classes up in mlx_lm.models.cache's globals; the integration makes them
visible there (another branch), so this test does the same with monkeypatch. What it checks is
ours: each layer's state survives safetensors one layer at a time, and after relink the caches
continue exactly as the originals."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.cross_layer import CrossLayerCoordinator

B, H, D, REP = 1, 2, 64, 2

CONFIGS = [
    KVCacheConfig(method="xquant", xquant_residual_length=8),
    KVCacheConfig(method="minicache", minicache_start_fraction=0.0, minicache_bits=4),
    KVCacheConfig(method="pyramidkv", pyramidkv_budget=40, pyramidkv_window=8),
]


def forward(caches, n, seed):
    outs = []
    for i, cache in enumerate(caches):
        key = mx.random.key(seed * 10 + i)
        k, v, q = (mx.random.normal(s, key=mx.random.split(key, 3)[j]).astype(mx.float16)
                   for j, s in enumerate([(B, H, n, D), (B, H, n, D), (B, H * REP, n, D)]))
        mask = cache.make_mask(n)
        cache.update_and_fetch(k, v)
        outs.append(cache.attention(q, scale=D**-0.5, mask=mask))
    mx.eval(outs)
    return outs


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.method)
def test_save_load_relink_continues_identically(config, tmp_path, monkeypatch):
    caches = CrossLayerCoordinator.build_layers(config, 4)
    forward(caches, 90, 0)
    forward(caches, 1, 1)
    for cache in caches:
        monkeypatch.setitem(mlx_cache.__dict__, type(cache).__name__, type(cache))
    path = str(tmp_path / "prompt.safetensors")
    mlx_cache.save_prompt_cache(path, caches)
    loaded = mlx_cache.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    CrossLayerCoordinator.relink(loaded)
    assert sum(c.nbytes for c in loaded) == sum(c.nbytes for c in caches)
    for seed in (2, 3):
        for a, b in zip(forward(caches, 1, seed), forward(loaded, 1, seed)):
            assert mx.array_equal(a, b).item()
