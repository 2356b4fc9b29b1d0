"""An independent copy of a prompt-filled list of our caches, to continue the prompt two ways.

Why: `veloxquant demo` decodes one prompt twice with the compressed cache (greedily, and
teacher-forced along the fp16 continuation). On a CPU without a fast BLAS the prompt's prefill
is most of a run (SmolLM2-135M in float32, a 410-token prompt: ~50 s of ~65 on 2 cores), so the
demo prefills once and continues a copy.

What is copied: each cache's `state` (the meta JSON, the exact window, the store arrays and any
method extras) rebuilt through the class's `from_state`, as mlx-lm's load_prompt_cache does, with
every array copied (`mx.array(a)`): MLX's slice writes (`a[i] = x`, the stores' in-place block
writes) update the array object itself, so a shared array would carry one copy's writes into the
other. A cross-layer method's layers get a fresh coordinator (CrossLayerCoordinator.relink), as
after a load. The attention dispatcher attaches itself to a cache at its first call.
"""

from __future__ import annotations


def fork_caches(caches: list) -> list:
    """A copy of `caches` (one per layer, all veloxquant caches) that continues exactly as the
    original would, with no array shared between the two."""
    import mlx.core as mx
    from mlx.utils import tree_map

    from veloxquant_mlx.cache.base import CompressedKVCache
    from veloxquant_mlx.cache.cross_layer import CROSS_LAYER_METHODS, CrossLayerCoordinator
    from veloxquant_mlx.errors import QuantizerConfigError

    copies = []
    for index, cache in enumerate(caches):
        if not isinstance(cache, CompressedKVCache):
            raise QuantizerConfigError(
                f"fork_caches: entry {index} is {type(cache).__name__}; allowed are veloxquant's "
                "compressed caches (CompressedKVCache)"
            )
        state = tree_map(lambda a: mx.array(a) if isinstance(a, mx.array) else a, cache.state)
        copies.append(type(cache).from_state(state))
    if copies and copies[0].config.method in CROSS_LAYER_METHODS:
        CrossLayerCoordinator.relink(copies)
    return copies
