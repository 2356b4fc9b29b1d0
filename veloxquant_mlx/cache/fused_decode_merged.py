"""A CUDA decode-step kernel for MiniCache's paired layers (merged directions + magnitudes).

Why: on the H200 minicache decoded at 0.54x the fp16 cache's tokens/s at 32K tokens (issue 5).
Its plain layers already run mx.fast attention (cache/growing_window.py); its paired layers took
the portable path (`_scores` / `_weighted_values` under CompressedKVCache._attend: matmuls over
the directions, the slots and the window, magnitude products, the retained slots scattered over
a materialized (rows x tokens) score array and gathered again for the values, slack masking,
concatenations, softmax: about two dozen MLX ops per layer and step, by reading the code). This
kernel reads the pair's directions, the layer's magnitudes and its retained slots once and
produces flash-decoding partials (m, l, o) per block of tokens; fused_decode's merge kernel
(imported, unchanged) combines them into the output row. Per layer and step: 2 kernels.

What one paired layer reads per KV head (minicache.py's store; MiniCache, arXiv 2405.14366):
  * dk, dv (B, H, cap_pair, D / DV): the pair's merged unit directions, fp16, held by the lower
    layer (the upper layer reads its partner's arrays: the same pointers, no copy); with
    `minicache_bits` B their per-token codes (B, H, cap_pair, D * B / 32) uint32 (mx.quantize's
    layout) plus fp16 scales and biases dks, dkb, dvs, dvb (B, H, cap_pair, D / 32);
  * mk, mv (B, H, cap): this layer's magnitudes ||k||, ||v|| per token (fp16);
  * rk, rv (B, H, cap / 32 * S, D / DV), pk, pv (B, H, cap / 32 * S) int32: per block of 32
    tokens S retained slots, the layer's exact vector and its absolute position (-1: unused);
    keys and values choose their slots separately;
  * wk, wv (B, H, W, D / DV): the exact window (the newest tokens, not merged yet).
Attention over it:
  score_t = ||k_t|| (q . e_k,t), or q . k_t exactly where t is a retained key;
  out = sum_t p_t ||v_t|| e_v,t over the tokens whose value is not retained
        + sum_slots p_pos v_slot  (+ the window's exact tokens, as any softmax term).
The magnitudes are folded in per token, not per channel: into the score after the dot product
(one multiply per row and token) and into the probability before the value sum (p ||v||), so
the per-element work is the fp16 -> float conversion and one FMA per query row, as in fp16
attention; the directions are read exactly as many bytes as fp16 K/V (the bytes a pair saves
are the upper layer's: it holds no K/V of its own), so this kernel has to be as efficient as
mx.fast's attention to reach the fp16 cache's speed.

Work split: blocks of 4 warps per (batch * kv head, range of history tokens), the last block per
head over the exact window. A warp walks tiles of 32 tokens (a tile is one MiniCache block of
32, so its S slots belong to it and the slot positions lie inside it):
  scores: 8 lanes share one token, each lane owning 8-channel chunks interleaved so that one
    load instruction of the warp reads 4 tokens' 128-byte runs (fully used sectors); a lane
    holds partial dot products of 8 tokens (the tile's 32 = 8 iterations x 4 tokens), which a
    transposing butterfly over the 8 lanes sums so that each lane ends owning one token's score
    (7 shuffles per row per 8 tokens instead of 24); the GQA rows (R) share every load. The
    tile's retained key slots: their exact dots the same way (one slot per 8 lanes), written to
    shared memory, and the owning lane's score replaced;
  online softmax over the tile (warp shuffles); per token the value weight p ||v|| (0 for a
    retained value) and per slot its p go to shared memory;
  values: DV / 8 lanes share one token (8 channels = 16 bytes each), 32 * 8 / DV tokens per
    round (one contiguous run of rows per round), loads of up to 8 rounds issued before their
    FMAs; then the tile's retained value rows the same way.
Accumulators per lane: R x 8 value sums, 8 x R partial dots: R <= 8 keeps them in registers.
Quantized directions: a lane's 8-channel chunk lies in one group of 32, so the group's scale
and bias are applied per chunk, not per element: for keys s (sum q c) + b (sum q) with the
query's sums per chunk precomputed in shared memory, for values (p s) c per element and p b
once per row into a bias accumulator; codes become floats by a mantissa trick (vq_u2f), not
the conversion unit. Per element: extract, convert, one FMA per row.

Numerics: everything after the loads is float32 and the output is rounded once to the queries'
dtype; the portable path in fp16 / bf16 rounds its scores, probabilities and sums in that dtype
(the tests compare against it with float32 queries). No other deviation from the portable
path: the same tokens, slots and window, the same softmax.

`supports()` lists what it takes (others: the portable path): fp16 directions or 2, 4, 8-bit
codes (3-bit codes straddle words: refused), head_dim and value dim 64, 128 or 256, slots
0..16, 1..8 query rows per kv head, shared memory under 48 KB.

Checked on the CPU only: tests/cache/test_fused_decode_minicache_emulated.py runs this source
under the thread-level emulation (tests/cache/cuda_emulation.py) through MiniCacheCache's real
decode path, against its portable attention (float32 / fp16 / bf16, GQA and MHA, fp16 and 2/4/8-
bit directions, 0..16 slots, several blocks and tiles per warp, a ragged window);
tests/cache/test_fused_decode_minicache_nvcc.py compiles it with nvcc 13.0 for sm_90 (the 8B
shape: 222 registers with the value prefetch, 170 without, 208 with 4-bit directions, no spills;
fused_decode's kivi kernel takes 184). On the H200 (session 4) 3 of its CUDA tests passed (the
8B shape bf16, fp16 MHA without slots, float32 GQA 8 with 16 slots) and minicache decoded at 1.12x
fp16 at 32K (results/gpu_speed_h200_s4.json); one layer's timing: python -m
veloxquant_mlx.bench.attention --methods fp16,minicache:minicache_start_fraction=0 ...
On an H100 (session 44, python -m veloxquant_mlx.bench.pair_probe, results/pair_probe_h100_s44*.json)
a paired layer took 0.087-0.099 ms at 32K and 0.258-0.271 at 128K against mx.fast's 0.058-0.064
and 0.184-0.187 over the fp16 KVCache's views: 1.4-1.5x the time for the same bytes, which is
what puts its four paired layers ~0.13 ms (32K) above fp16's attention in minicache's 8-layer
step (its step 2.38-2.43 ms against fp16's 2.16 in fp16's fast rounds, results/gpu_speed_h100_s44_32k.json).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header, merged_partials_source
from veloxquant_mlx.errors import QuantizerConfigError

TILE = 32  # tokens per warp tile = MiniCache's block of 32 (its retained slots are per block)
WARPS_PER_BLOCK = 4
MAX_TILES_PER_WARP = 256
# Target warps of this kernel's launches: fused_decode's 4096 until session 27, kept here when
# fused_decode.TARGET_WARPS (GEAR's and KVQuant's) became 8192, 1024 since session 44. One paired
# layer of the 8B shape on an H100, ms per chained call (bench.pair_probe --variants, one process,
# results/pair_probe_h100_s44_{variants,warps}.json), lower / upper layer: at 32K 4096 0.096 /
# 0.097, 1024 0.087 / 0.090, 2048 0.091-0.092, 8192 0.110-0.114, 512 0.117-0.118; at 128K 4096
# 0.266-0.271, 1024 0.258 / 0.259, 2048 0.260-0.263, 8192 0.280, 512 0.396 (fewer, longer warps
# keep more of each warp's loads in flight per block; the prefetch off or launch bounds of 3 / 4
# blocks per SM were no faster). In the 8-layer model's interleaved 32K decode the ~30 us per step
# it saves does not show against the run's spread (results/gpu_speed_h100_s44_32k_minicache_tw.json:
# paired 0.92x fp16, with 4096 as the `minicache-tw4096` ablation 0.94x, quartiles 0.89-0.99);
# the kernel's CUDA tests pass with it (results/cuda_tests_h100_s44_minicache_tw1024.txt). Not
# measured on an H200.
TARGET_WARPS = 1024
MAX_ROWS = 8
MAX_SLOTS = 16
HEAD_DIMS = (64, 128, 256)  # 8 lanes x 8-channel chunks per key token, 8 channels per value lane
DIRECTION_BITS = (2, 4, 8)  # minicache_bits whose codes never straddle a 32-bit word
# Load a history tile's first 8 value rounds (fp16 directions) before its scores: more bytes in
# flight per warp at no occupancy cost (see PV in the kernel). On in the H200 run of session 4;
# not yet compared against off there.
PREFETCH_FIRST_VALUES = True
PREFETCH_MAX_ROWS = 4  # 8 rows spill with it (1128 bytes at float32, 16 slots; 604 without)

# This module's kernel text (merged_partials_source.py), under the names every decode kernel
# module gives its own (the emulated tests' mutations and bench.batch_probe's variants patch them here).
_HEADER = kernel_header.HEADER + merged_partials_source.HELPERS

_PARTIALS = merged_partials_source.PARTIALS

_INPUTS = ["q", "dk", "dv", "dks", "dkb", "dvs", "dvb", "mk", "mv", "rk", "rv", "pk", "pv", "wk", "wv", "meta", "wn"]


@lru_cache(maxsize=None)
def _partials_kernel():
    return fused_decode.PartialsKernel("vq_merged_decode_partials", _INPUTS, _PARTIALS, _HEADER)


def tokens_per_block(n_tokens: int, n_heads: int) -> int:
    """History tokens per block of 4 warps: 32-token tiles, enough warps to fill the GPU
    (TARGET_WARPS over all heads), at most MAX_TILES_PER_WARP tiles per warp."""
    return fused_decode.tokens_per_block(n_tokens, n_heads, TILE, MAX_TILES_PER_WARP, TARGET_WARPS)


def shared_bytes(head_dim: int, value_dim: int, slots: int, rows: int) -> int:
    """Static shared memory of the kernel: the query and its sums per 8 channels, per warp
    max((32 + 2 slots + 1) x R, DV x R) floats, per warp and row a max and a sum."""
    per_warp = max((TILE + 2 * max(slots, 1) + 1) * rows, value_dim * rows)
    return 4 * (head_dim * rows + head_dim // 8 * rows + WARPS_PER_BLOCK * (per_warp + 2 * rows))


def supports(head_dim: int, value_dim: int, slots: int, rows: int, direction_bits) -> bool:
    """The shapes the kernel takes; others take the portable path: fp16 directions
    (direction_bits None) or codes of DIRECTION_BITS bits (3-bit codes straddle words: refused),
    head_dim and value dim in HEAD_DIMS, 0..16 slots, 1..8 query rows per kv head (the lane's
    8 x R partial dots and R x 8 value sums), shared memory <= 48 KB."""
    if direction_bits is not None and direction_bits not in DIRECTION_BITS:
        return False
    if head_dim not in HEAD_DIMS or value_dim not in HEAD_DIMS:
        return False
    if not 0 <= slots <= MAX_SLOTS or not 1 <= rows <= MAX_ROWS:
        return False
    return shared_bytes(head_dim, value_dim, slots, rows) <= kernel_header.STATIC_SHARED_BYTES


def decode_step(cache, queries, scale: float):
    """A paired MiniCacheCache layer's decode-step attention through the kernels, or None where
    they are not active (off CUDA, switched off, a plain layer, a shape supports() refuses, a
    partner whose directions no longer cover the history): the portable path then runs."""
    if cache.role == "plain" or not fused_decode.kernels_enabled():
        return None
    # The plan (fused_decode.planned_attend) holds while, where the directions are the lower
    # partner's, that store is unwritten too (store_writes).
    lower = None if cache.owns_directions else cache._peer(cache.layer_index - 1)
    key = (cache.role, cache.owns_directions, None if lower is None else (id(lower), lower.store_writes))

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        if not supports(cache.head_dim, cache.value_dim, cache.slots, rows, cache.dir_bits):
            return None
        source = cache._direction_store()
        dk, dv = source["dir_k"], source["dir_v"]
        if dk.shape[2] < cache.n_compressed:
            return None  # a trimmed partner no longer holds these positions' directions
        side = None
        if cache.dir_bits is not None:
            side = tuple(source[n] for n in ("dirscale_k", "dirbias_k", "dirscale_v", "dirbias_v"))
        s = cache.store
        retained = None
        if cache.slots:
            retained = (s["ret_k"], s["ret_v"], s["retpos_k"], s["retpos_v"])
        meta_cache = cache.__dict__.setdefault("_merged_meta", fused_decode.FusedDecodeMeta())
        return merged_launch(
            queries, scale, dk, dv, s["mag_k"], s["mag_v"], retained, cache.window_keys,
            cache.window_values, n_valid=cache.n_compressed, slots=cache.slots,
            n_kv_heads=cache.n_kv_heads, meta_cache=meta_cache, direction_bits=cache.dir_bits,
            direction_side=side,
        )

    return fused_decode.planned_attend(cache, queries, scale, key, launch, _partials_kernel)


def merged_decode_attention(
    queries, scale: float, dir_k, dir_v, mag_k, mag_v, retained, window_keys, window_values, *,
    n_valid: int, slots: int, n_kv_heads: int, meta_cache: fused_decode.FusedDecodeMeta,
    direction_bits=None, direction_side=None,
):
    """The attention of merged_launch's launch, (B, Hq, 1, DV) in the queries' dtype, in one call
    (decode_step keeps the launch in a plan instead)."""
    inputs, shape, _ = merged_launch(
        queries, scale, dir_k, dir_v, mag_k, mag_v, retained, window_keys, window_values,
        n_valid=n_valid, slots=slots, n_kv_heads=n_kv_heads, meta_cache=meta_cache,
        direction_bits=direction_bits, direction_side=direction_side)
    return _partials_kernel().attend(queries, inputs=inputs, **shape)


# Where merged_launch's input list holds the window (keys, values).
WINDOW_INPUTS = (_INPUTS.index("wk"), _INPUTS.index("wv"), _INPUTS.index("wn"))


def merged_launch(
    queries, scale: float, dir_k, dir_v, mag_k, mag_v, retained, window_keys, window_values, *,
    n_valid: int, slots: int, n_kv_heads: int, meta_cache: fused_decode.FusedDecodeMeta,
    direction_bits=None, direction_side=None,
):
    """softmax(q K^T * scale) V for one query row per head, queries (B, Hq, 1, D), over the
    merged history [0, n_valid) (directions (B, H, cap_pair, D) fp16, or with direction_bits
    their codes (B, H, cap_pair, D * bits / 32) and direction_side = (key scales, key biases,
    value scales, value biases) (B, H, cap_pair, D / 32); magnitudes (B, H, cap); retained =
    (ret_k, ret_v, retpos_k, retpos_v) or None for 0 slots) and the exact window (B, H, W, D),
    W >= 1 -> (B, Hq, 1, DV) in the queries' dtype: the launch's (inputs, {template, n_blocks,
    heads, value_dim}, the window's input slots) for fused_decode.planned_attend. Only call when
    kernels_enabled() and supports(...): decode_step checks."""
    B, n_q_heads, _, D = queries.shape
    R = n_q_heads // n_kv_heads
    BH = B * n_kv_heads
    DV = window_values.shape[-1]
    if n_valid % TILE or not 0 < n_valid <= min(dir_k.shape[2], mag_k.shape[2]):
        raise QuantizerConfigError(
            f"merged fused decode: n_valid={n_valid} with directions of {dir_k.shape[2]} and "
            f"magnitudes of {mag_k.shape[2]} tokens; allowed is a positive multiple of {TILE} "
            "within both"
        )
    if (retained is None) != (slots == 0):
        raise QuantizerConfigError(
            f"merged fused decode: slots={slots} but retained arrays "
            f"{'missing' if retained is None else 'given'}; allowed is retained arrays exactly when slots > 0"
        )
    if (direction_side is None) != (direction_bits is None):
        raise QuantizerConfigError(
            f"merged fused decode: direction_bits={direction_bits} but scales and biases "
            f"{'missing' if direction_side is None else 'given'}; allowed is both or neither"
        )
    if retained is None:
        absent = fused_decode.absent_input
        retained = (absent(mx.float16), absent(mx.float16), absent(mx.int32), absent(mx.int32))
    if direction_side is None:
        direction_side = (fused_decode.absent_input(mx.float16),) * 4
    per_block, n_hist_blocks, n_blocks = fused_decode.history_blocks(
        n_valid, BH, "merged fused decode", tokens_per_block)
    meta = meta_cache.get(n_valid, per_block, n_hist_blocks, float(scale))
    dtype = queries.dtype
    inputs = [queries, dir_k, dir_v, *direction_side, mag_k, mag_v, *retained,
              window_keys.astype(dtype), window_values.astype(dtype), meta,
              fused_decode.window_rows(window_keys.shape[2])]
    template = [("D", D), ("DV", DV), ("R", R), ("PV", int(PREFETCH_FIRST_VALUES and R <= PREFETCH_MAX_ROWS)),
                ("S", slots), ("DB", direction_bits or 0), ("QT", dtype), ("DT", dir_k.dtype),
                ("ST", direction_side[0].dtype), ("MT", mag_k.dtype), ("RT", retained[0].dtype), ("WB", 0)]
    return inputs, {"template": template, "n_blocks": n_blocks, "heads": BH, "value_dim": DV}, WINDOW_INPUTS
