"""Decode steps of a small model's caches, for tests that set a cache switch and compare: a
4-layer random llama with the 8B attention shape (so cross-layer methods pair up as in a model:
minicache merges the second half's pairs, its first half are plain caches), 1024 tokens
prefilled on the portable path, then one-token steps."""

import contextlib

import mlx.core as mx

from veloxquant_mlx.bench import step_census
from veloxquant_mlx.bench.tiny import random_llama

SHAPE = dict(kv_heads=8, heads=32, head_dim=128, dtype=mx.bfloat16)


def decode_outputs(method: str, settings: dict, *, steps: int = 1, around=contextlib.nullcontext):
    """The attention outputs of `steps` decode steps of every layer's cache of `method`, each
    cache's attributes set from `settings` after the prefill (on every cache: minicache's plain
    layers take them too); the steps (not the prefill) run inside `around()` -> (outputs, caches)."""
    model = random_llama(hidden=256, layers=4, intermediate=64, vocab=64, dtype=mx.bfloat16,
                         **step_census.LLAMA_8B_ATTENTION)
    outputs = []
    with step_census.method_caches(method, model) as (caches, attention):
        step_census.prefill(caches, attention, history=1024, chunk=512, seed=0, **SHAPE)
        for cache in caches:
            for name, value in settings.items():
                setattr(cache, name, value)
        with around():
            for s in range(steps):
                for i, cache in enumerate(caches):
                    k, v, q = (step_census._random(shape, mx.bfloat16, 100 * s + 10 * i + j) for j, shape in enumerate(
                        ((1, 8, 1, 128), (1, 8, 1, 128), (1, 32, 1, 128))))
                    keys, values = cache.update_and_fetch(k, v)
                    outputs.append(attention(q, keys, values, cache=cache, scale=128 ** -0.5, mask=None))
                mx.eval(outputs)
    return outputs, caches


def assert_same_attention(expected: list, got: list) -> None:
    """Equal outputs but for one bf16 rounding: two runs of one build are not always bit for bit
    (kvquant's first decode step differed by up to 9.5e-7 between two emulated runs of the
    shipped build, one ulp of its smallest outputs; a bf16 ulp is at most 2^-7 of the value)."""
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        e, g = e.astype(mx.float32), g.astype(mx.float32)
        assert mx.all(mx.abs(e - g) <= 2 ** -7 * mx.abs(e) + 1e-6).item(), mx.abs(e - g).max().item()


def emulated_decode_launches(method: str, settings: dict) -> list:
    """(kernel, signature) of every fused decode launch of one step (decode_outputs with
    `settings`), the kernels emulated and not run: what a test of a launch's build compares."""
    from tests.cache import cuda_emulation
    from veloxquant_mlx.cache.kernel_name import base_name

    captured = []

    @contextlib.contextmanager
    def emulated():
        with cuda_emulation.emulated_kernels(), cuda_emulation.signatures_only() as launches:
            yield
        captured.extend(launches)

    decode_outputs(method, settings, around=emulated)
    return [(k, sig) for k, sig in captured if "_decode_partials_merged" in base_name(k.name)]
