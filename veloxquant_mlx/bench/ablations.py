"""Code ablations: variants of a method that no KVCacheConfig field expresses, for measuring
what one design choice of ours is worth. Named like cache specs (`gear-magnitude`,
`gear-block64:gear_rank=0`) and accepted wherever the measurement modules take `--methods`.

They exist only for measurements; nothing outside veloxquant_mlx.bench builds them.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.gear import GEARCache


class MagnitudeGEAR(GEARCache):
    """GEAR with outliers picked by largest |x|, the paper's literal filter (Kang et al. 2024,
    GEAR, Sec. 3), instead of our distance from the quantization group's mean."""

    def _selection_centres(self, blocks, per_channel):
        return mx.zeros_like(blocks)


class SmallBlockGEAR(GEARCache):
    """GEAR with 64-token blocks: the history is compressed from position 64 on instead of 256
    (costs bytes: the per-block factor B and the outlier indices amortize over fewer tokens)."""

    block_tokens = 64


class Marked:
    """An ablation that is a method's own caches with one attribute set per instance (a
    per-cache switch whose module-wide default stays as shipped): `kivi` and `kivi-inplace` in
    one interleaved gpu_speed run are an A/B on one machine, seconds apart (a --set holds for a
    whole process, and two processes meet two machine states). Called as a builder it gives one
    layer's cache from the factory; a model's lists come from the patch and go through `mark`
    (layer_specs.LayerSpec.open): cross-layer methods share a coordinator over the list."""

    def __init__(self, attribute: str, value, **more):
        self.settings = {attribute: value, **more}  # every attribute the ablation sets

    def mark(self, caches: list) -> list:
        from veloxquant_mlx.cache.base import CompressedKVCache

        ours = [c for c in caches if isinstance(c, CompressedKVCache)]
        if not ours:
            raise TypeError(f"no cache of {[type(c).__name__ for c in caches]} is one of ours "
                            f"(the ablation sets {', '.join(self.settings)})")
        for cache in ours:
            for attribute, value in self.settings.items():
                setattr(cache, attribute, value)
        return caches

    def __call__(self, config, layer_index: int, n_layers: int):
        from veloxquant_mlx.cache.factory import KVCacheFactory

        return self.mark([KVCacheFactory.create(config, layer_index, n_layers)])[0]


class PlainLayersAsKVCache(Marked):
    """MiniCache with its plain layers (below minicache_start_fraction, an unpaired last one)
    held by mlx-lm's own KVCache instead of our growing window: what our plain layers cost a
    decode step beside mlx-lm's cache in one interleaved run. Why: on the H100 (session 43)
    minicache's step held 0.11-0.15 ms more host than both its all-plain and its all-paired
    forms, neither of which pays it, and its Python build does not hold the difference."""

    def __init__(self):
        # A Marked for the patch's own lists (layer_specs, step_census), but it sets no
        # attribute: it swaps list entries.
        self.settings = {}

    def mark(self, caches: list) -> list:
        from mlx_lm.models.cache import KVCache

        from veloxquant_mlx.cache.minicache import MiniCacheCache

        if not any(isinstance(c, MiniCacheCache) for c in caches):
            raise TypeError(f"no cache of {[type(c).__name__ for c in caches]} is a MiniCacheCache")
        # A plain layer is nobody's partner: the pairs' coordinator never reads it.
        return [KVCache() if isinstance(c, MiniCacheCache) and c.role == "plain" else c for c in caches]


plain_layers_as_kv_cache = PlainLayersAsKVCache()

# The decode window written in place (cache/window_buffer.py), whatever
# base.DECODE_WINDOW_IN_PLACE says.
in_place_window = Marked("decode_window_in_place", True)

# GEAR's CUDA decode kernel reading every sparse entry of a tile's block, as before session 29,
# instead of the tile's run of them (fused_decode_gear.SORTED_SCAN).
full_scan = Marked("sorted_scan", False)

# The affine decode kernel weighing the history's values on tensor cores
# (fused_decode.MMA_VALUES, on as shipped since session 30): kivi and xquant only (the plain kernel).
tensor_core_values = Marked("mma_values", True)
# ... and its scores too (fused_decode.MMA_SCORES, session 22): both products on tensor cores.
tensor_cores = Marked("mma_values", True, mma_scores=True)
# ... and neither: the FMA loops as before session 30 (both switches on as shipped since).
fma_loops = Marked("mma_values", False, mma_scores=False)
MMA_VALUES_METHODS = ("kivi", "xquant")

# The decode kernel's launches split for N target warps whatever the kernel's own target
# (fused_decode.tokens_per_block): one layer's chained attention on the H200 was ~15% faster at
# 32K for kivi and xquant with 1024 than with 4096 (session 22, when AFFINE_TARGET_WARPS became
# 1024) and slower for gear; these measure such a split through a model's decode, per method.
TARGET_WARPS_TRIED = (1024, 2048, 4096, 8192)


# The fused decode launch with its template constants written into the kernel's source
# (fused_decode.BAKED_CONSTANTS, off as shipped): MLX's host work per call without them. The
# launch uncompiled: a compiled one handles its constants at its trace only.
baked_constants = Marked("baked_constants", True, compiled_launch=False)

# The fused decode launch through mx.compile (fused_decode.COMPILED_LAUNCH, on as shipped since
# session 36: MLX replays the traced kernel call), with the in-place window it needs; and the
# uncompiled launch of the window concatenated each step, as shipped before, for the A/B.
compiled_launch = Marked("compiled_launch", True, decode_window_in_place=True)
uncompiled_launch = Marked("compiled_launch", False)

# The fused decode launch built from its header and source as written, comments and
# indentation in, as before session 36 (cache/kernel_text.py compacts them as shipped): what the
# smaller text saves of MLX's host work per call, paired with the shipped launch in one run.
text_as_written = Marked("kernel_text_as_written", True, compiled_launch=False)

# The compiled decode launch with its compacted text handed to MLX inline, as before session 41
# (cache/kernel_files.py hands it as #includes of files as shipped): what the files save of a
# replay's host time, paired with the shipped launch in one run.
text_inline = Marked("kernel_text_inline", True)

# KVQuant's portable decode readers (kvquant_attention.py: what Metal, the CPU and CUDA with
# VELOXQUANT_CUDA_KERNELS=0 run) taking the history in chunks of N tokens, whatever the
# device's default (KVQuantCache.decode_chunk_tokens): each chunk is ~30 more primitives per
# layer and step, a larger chunk a larger float32 transient.
KVQUANT_CHUNKS_TRIED = (1024, 4096, 16384)

# The methods whose decode steps append to the base's exact window (pyramidkv's update is its own).
WINDOW_METHODS = ("kivi", "xquant", "turboquant_rvq", "minicache", "gear", "kvquant")

# spec name -> (builder: class or function of (config, layer_index, n_layers), the method whose
# KVCacheConfig fields it takes, label)
ABLATIONS: dict[str, tuple] = {
    "gear-magnitude": (MagnitudeGEAR, "gear", "gear, outliers by |x| (paper literal)"),
    "gear-block64": (SmallBlockGEAR, "gear", "gear, 64-token blocks"),
    "gear-fullscan": (full_scan, "gear", "gear, decode kernel scanning every outlier of a block"),
    **{f"{m}-mmav": (tensor_core_values, m, f"{m}, decode values weighed on tensor cores")
       for m in MMA_VALUES_METHODS},
    **{f"{m}-tc": (tensor_cores, m, f"{m}, decode scores and values on tensor cores")
       for m in MMA_VALUES_METHODS},
    **{f"{m}-fma": (fma_loops, m, f"{m}, decode scores and values by FMA loops")
       for m in MMA_VALUES_METHODS},
    **{f"{m}-inplace": (in_place_window, m, f"{m}, decode window written in place") for m in WINDOW_METHODS},
    **{f"{m}-baked": (baked_constants, m, f"{m}, decode launch constants in the kernel source")
       for m in WINDOW_METHODS},
    **{f"{m}-compiled": (compiled_launch, m, f"{m}, decode launch through mx.compile, window in place")
       for m in WINDOW_METHODS},
    **{f"{m}-uncompiled": (uncompiled_launch, m, f"{m}, decode launch uncompiled, window concatenated")
       for m in WINDOW_METHODS},
    **{f"{m}-verbatim": (text_as_written, m, f"{m}, decode launch from its kernel text as written")
       for m in WINDOW_METHODS},
    **{f"{m}-inline": (text_inline, m, f"{m}, compiled decode launch with its kernel text inline")
       for m in WINDOW_METHODS},
    **{f"{m}-tw{n}": (Marked("decode_target_warps", n), m, f"{m}, decode launches for {n} target warps")
       for m in WINDOW_METHODS for n in TARGET_WARPS_TRIED},
    **{f"kvquant-chunk{n}": (Marked("decode_chunk_tokens", n), "kvquant", f"kvquant, portable decode in {n}-token chunks")
       for n in KVQUANT_CHUNKS_TRIED},
    "minicache-kvplain": (plain_layers_as_kv_cache, "minicache", "minicache, plain layers in mlx-lm's KVCache"),
}
