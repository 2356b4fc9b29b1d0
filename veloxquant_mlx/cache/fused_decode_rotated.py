"""A CUDA decode-step kernel for TurboQuantRVQCache's store (rotated, two-stage codes per token).

Why: on MLX's CUDA backend a turboquant_rvq decode step ran as ~20 small ops per layer (query
rotation, one quantized_matmul per stage for the scores and again for the values, sign-plane
widening, the key-mean bias, the sink correction, concatenations, softmax, unrotation) and
decoded at 0.29x the fp16 cache's tokens/s on the H200 (issue 5). This kernel reads every
token's packed codes once and produces flash-decoding partials (m, l, o) per block of tokens,
each block's o already rotated back to the original basis; fused_decode.py's merge kernel
(imported, unchanged) combines them into the output row. Per layer and step: 2 kernels instead
of ~20 ops.

What one compressed token holds (turboquant_rvq.py; per token, along the channel axis, in the
rotated basis y = H (s * x) / sqrt(d), keys centered by the cache's key mean first):
  stage 1 (total bits 3, 4): B1 = 2 or 3-bit uniform codes, mx.quantize's little-endian bit
          stream along channels (3-bit codes straddle uint32 words), fp16 scale and zero per
          group of min(64, d) channels: y1 = scale * code + zero;
  stage 1 (total bits 2): a sign plane like stage 2 (1 bit per channel, one fp16 magnitude a1):
          read as the 1-bit affine code with scale 2 a1, zero -a1 over one group of d channels;
  stage 2 (always): 1 sign bit per channel, one fp16 magnitude a per token: y2 = a (2 bit - 1).
Total bits 1 has stage 2 only. Keys and values may have different widths (template KB1, VB1).

The algorithm (tests/cache/rotated_decode_reference.py states it in MLX ops for the CPU tests):
  * the scaled query is rotated in the kernel (Walsh-Hadamard butterflies in shared memory, the
    Sylvester order mx.hadamard_transform uses); per compressed token
      score = q_rot . (y1 + y2) + bias,   bias = q . key_mean (a constant per row);
    per channel y = scale * code + (zero + a or zero - a by the sign bit): the sign picks one
    of two zeros, the code becomes a float by a mantissa trick instead of the int-to-float
    conversion unit (a slow path on Hopper), then one FMA per query row. The first version
    summed q_rot * code and q_rot * bit per group (two FMAs per row and channel, two
    conversions): 0.44 ms per layer at 128K tokens, 2.2x the fp16 SDPA;
  * values accumulate in the rotated basis, o = sum_t p_t (y1_t + y2_t), and each history
    block rotates its o back at its end, s * (H o) / sqrt(DV) (butterflies over R x DV floats
    in shared memory): the merge is linear in o, so unrotating every partial before it equals
    unrotating the merged row, and it saves the 2-3 ops per layer an MLX unrotation would cost;
  * the exact tokens (the attention sink's exact K/V, then the window) form the last block.
    They are scored against the UNROTATED query (no bias: they are not centered) and their
    values accumulate unrotated, so that block needs no rotation at all. Why not rotate the
    window's K/V per step in MLX instead: 4 more ops per layer and step (two transforms, two
    sign products), which is what this kernel removes;
  * the sink: compressed token 0 (its codes stay in the store) is skipped, and the exact sink
    (decoded token 0 + the cache's float32 deltas, derived once and kept on the cache) is
    attended as an exact token, which is what the portable path's correction computes;
  * merge (fused_decode's kernel 2) -> the output row in the queries' dtype.

Work split of the partials kernel: blocks of 4 warps per (batch * kv head, range of tokens),
the last block per head over the exact tokens. A warp walks tiles of 32 tokens:
  scoring: lane i owns token base + i and reads that token's key words (a contiguous run of
    D * B1 / 32 + D / 32 words; the warp's 32 lanes read 32 consecutive tokens, i.e. one
    contiguous stretch of memory) in chunks of 32 channels (B1 stage-1 words + one sign word
    per chunk); the rotated query (R rows) is read from shared memory, broadcast to all lanes;
  online softmax over the tile (warp shuffles), probabilities to shared memory;
  values: LPT = DV / CPL lanes share one token, each owning CPL channels (its stage-1 bits,
    re-aligned with a funnel shift when 3-bit codes cross a word, and part of a sign word), so
    32 / LPT tokens go per round and a round reads one contiguous run of value words; loads of
    up to 64 / CPL rounds are issued before their arithmetic.
Accumulators per lane: R score sums and R x CPL value sums, CPL = 16 channels while R x 16 fits
the value-sum budget MAX_VALUE_SUMS and 8 otherwise (channels_per_lane). The budget is 32 since
session 5: 16 channels at R = 1, 2 and 8 from R = 3 on (the 8B shape's 4 rows, SmolLM2's 3). It
was 64 in session 4 (16 channels up to R = 4, 8 above); before that 16 channels at every R, and
at R = 8 128 sums made ptxas spill (255 registers + 48 bytes of stack, fp16, d 128). The
stage-1 stream allows 8 channels at every width: a lane's 8 / 16 / 24 bits start on a multiple
of its width, so 1- and 2-bit lanes lie inside one word and a 3-bit lane crosses at most one
boundary (the funnel shift's case); its 8 sign bits are a quarter of one sign word. At totals 2
and 3 an 8-channel lane does not load the word after its bits (a plain shift).

Registers per thread of the partials kernel, nvcc 13.0 for sm_90 (`-Xptxas -v`), at
tests/cache/test_kernels_nvcc.py's shapes (the caches' own decode steps, the method's default 4
bits: 3-bit stage-1 codes), budget 64 (session 4) -> 32 (now), no spills or stack at either:
  bf16, 4 rows, d 128 (the 8B shape):  143 -> 108   blocks of 4 warps per SM: 3 -> 4
                                       (-> 96, 5 blocks, no spills, a 40-byte stack frame under
                                       the launch bounds of session 12: MIN_BLOCKS_PER_SM)
  bf16, 3 rows, d 64 (SmolLM2):        151 -> 106   3 -> 4
  fp16, 8 rows, d 128:                 130 -> 130   3 (8 channels at either budget)
  float32, 1 row, d 128:                80 ->  80   6 (16 channels at either budget)
  bf16, 4 rows, d 128 at other totals: 3 bits 146 -> 108 and 1 bit 144 -> 104 (3 -> 4 blocks);
  2 bits (a sign-plane stage 1) 130 -> 138, 3 blocks at either budget (there the split costs
  its extra loads without adding warps); no spills at totals 1..3, 2..8 rows, d 64 / 128.
(an SM's 65536 registers are handed out per warp in units of 256, i.e. 8 per thread: 4 blocks
need <= 128 registers, 5 need <= 96; 3 -> 4 blocks is 12 -> 16 resident warps per SM.) Why
fewer registers should help: at long contexts this kernel is latency-bound (few bytes per
element, many instructions), and more resident warps hide more load latency; kivi's kernel
went 184 -> 104 registers by the same split in session 4 and its partials 0.092 -> 0.086 ms per
layer at 32K on the H200. What it costs: at 4 rows, d 128 a value token is read by 16 lanes
instead of 8, so a 32-token tile takes 16 value rounds instead of 8; per lane and tile that is
16 x (2 stage-1 words, a sign word, scale, zero, magnitude) = 96 loads instead of 8 x 7 = 56
(the token's side values are read by twice as many lanes) and 16 x R probabilities from shared
memory instead of 8 x R; the FMAs are the same. Whether the warps win over the extra loads is
not known: no GPU figure exists for budget 32. The next GPU session must measure, budget 32 as
shipped and budget 64 set through the constant (the kernel factory is keyed on it and the launch
passes it as a template argument, so both settings can run in one process):
  python -m veloxquant_mlx.bench.kernel_probe --parts step --contexts 32768,131072 --methods fp16,turboquant_rvq
  python -c "import sys; from veloxquant_mlx.cache import fused_decode_rotated as f; f.MAX_VALUE_SUMS = 64; from veloxquant_mlx.bench import kernel_probe; sys.exit(kernel_probe.main(['--parts', 'step', '--contexts', '32768,131072', '--methods', 'fp16,turboquant_rvq']))"
  python -m veloxquant_mlx.bench.gpu_speed --methods fp16,turboquant_rvq --contexts 32768,131072 --repeats 2 --out results/gpu_speed_h200_rvq_sums32.json
  python -c "import sys; from veloxquant_mlx.cache import fused_decode_rotated as f; f.MAX_VALUE_SUMS = 64; from veloxquant_mlx.bench import gpu_speed; sys.exit(gpu_speed.main(['--methods', 'fp16,turboquant_rvq', '--contexts', '32768,131072', '--repeats', '2', '--out', 'results/gpu_speed_h200_rvq_sums64.json']))"
and `pytest -m cuda tests/cache/test_fused_decode_rotated.py` (its 4-row cases run the new split
on the GPU). Keep 32 if its step is faster at both contexts beyond the repeats' spread, else
set 64 back (issue 5's targets: >= 0.9x fp16's tokens/s at 32K, >= 1.0x at 128K; session 4's
figures at budget 64: 0.84x, repeats 0.65 / 1.04, and 1.18x).

`supports()` lists the shapes taken (others take the portable path): head_dim and value dim
powers of two in 32..256, stage-1 bits 0..3 (total 1..4), 1 <= R <= 8.

Checked: on the CPU, tests/cache/test_fused_decode_rotated.py runs this source under a
thread-level emulation (tests/cache/cuda_emulation.py) and the algorithm in numpy against the
portable attention. On the H200 (MLX 0.32.4 + mlx-cuda-13, 2026-11-30) the first version of
this kernel (commit 585ca45: per-group sums, int-to-float conversions) passed the file's CUDA
tests and measured, one layer, 8 kv heads x 4 query rows, d 128, bf16, 4-bit, median ms per
call with its eval [p10, p90] over 40 calls (the machine shared):
  32K tokens:  fused 0.22 [0.18, 0.44]  portable path 1.23-1.39  fp16 SDPA 0.11
  128K tokens: fused 0.44 [0.41, 0.57]  portable path 1.80-2.04  fp16 SDPA 0.20-0.22
(TARGET_WARPS 1024..8192 within the noise at 32K; 4096 best at 128K). The current kernel (one
FMA per row and channel, no conversion unit, unrotation inside the partials) passed the CUDA
tests there (`pytest tests/cache/test_fused_decode_rotated.py -k "kernel_step or many_tiles"`:
6 passed, commit 7b7f52c) and, in the whole 8-layer model at 32K tokens, decoded at 0.71x the
fp16 cache's tokens/s (417 vs 590, median of 2; 0.29x before any kernel;
results/gpu_speed_h200_s3.json). Its one-layer time alone was not measured.
The 8-channel value lanes above 4 rows (session 4) and at 3 and 4 rows (session 5's budget 32)
are checked on the CPU only (the emulation, nvcc's register report): neither their results nor
their speed on the H200 yet.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header, rotated_partials_source

TILE = 32  # tokens per warp tile: one per lane when scoring
WARPS_PER_BLOCK = 4
# Warps a launch aims at (its split of the history over blocks): 2048 since session 23. On the
# H200 one layer's whole chained attention (bench.launch_bounds_probe --warps 1024,2048,4096)
# took at 32K 93 us with 2048 against 103-105 with 4096 (104 with 1024), at 128K 256 against
# 257-259 (311 with 1024); in the 8-layer model's interleaved decode at 32K (gpu_speed
# --interleave, the ablation turboquant_rvq-tw2048 beside the method) 0.92x fp16's tokens/s
# (paired median) against 0.90x (results/lb_h200_s23_warps_*.json, gpu_speed_h200_s23_tw_32k.json).
TARGET_WARPS = 2048
MAX_TILES_PER_WARP = 256
# The budget of value sums per lane: a lane owns CPL = 16 value channels while R x 16 <= the
# budget, else 8 (channels_per_lane; the kernel's CPL). 32 since session 5 (8 channels from 3
# rows on: 108 registers instead of 143 at the 8B shape); it was 64 in session 4 (16 channels
# up to 4 rows). A module constant read at each launch: the kernel factory is keyed on it and
# the launch passes it as a template argument, so a probe may set it to time the other split.
# 8 channels take 16 lanes per value token at d 128 (32 at d 256), which the stage-1 stream
# allows at every width (a lane's 8 / 16 / 24 bits, at most one word boundary inside) and the
# sign words too (a quarter word per lane); below 8 a d-256 token would need 64 lanes.
MAX_VALUE_SUMS = 32
# Blocks per SM the kernel is compiled for (fused_decode.launch_bounds_header; 0: no bounds),
# at the shapes BOUNDED_SHAPES lists only. 5 since session 12: the 8B shape's kernel (bf16, 4
# rows, d 128) takes 108 registers unbounded, so 4 blocks fit an SM; bounded to 5 it takes 96
# (ptxas, no spills: tests/cache/test_kernels_nvcc.py) and one call at 128K tokens took 0.261 ms
# against 0.2845 unbounded in the same process, output bit-identical (results/lb_probe_h200_s12.json,
# one run; the unbounded kernel over three runs that day: 0.278-0.285 ms). Elsewhere
# the bounds are not measured and could cost: fp16 at 8 rows goes 130 registers -> 96 with a
# 280-byte stack frame, float32 at 1 row 79 -> 96 (6 blocks per SM -> 5). kivi's kernel moved
# 0.174 -> 0.170 ms, kvquant's not at all, GEAR's 0.266 -> 0.296: theirs stay unbounded. Read at
# each launch, like MAX_VALUE_SUMS: a probe may set 0 to time the kernel without bounds.
MIN_BLOCKS_PER_SM = 5
# (query rows per kv head, head_dim, queries' dtypes) the bounds apply to: the shape measured.
# Read once per (rows, head_dim, dtype) in a process (_bounded_shape's cache: asked every step).
BOUNDED_SHAPES = ((4, 128, (mx.bfloat16, mx.float16)),)
MAX_ROWS = 8
STAGE1_BITS = (0, 1, 2, 3)  # 0: no stage 1 (total 1 bit); 1: a second sign plane (total 2)


def launch_bounds(rows: int, head_dim: int, dtype) -> int:
    """MIN_BLOCKS_PER_SM where BOUNDED_SHAPES lists (rows, head_dim, the queries' dtype), else 0."""
    return MIN_BLOCKS_PER_SM if _bounded_shape(rows, head_dim, dtype) else 0


@lru_cache(maxsize=None)
def _bounded_shape(rows: int, head_dim: int, dtype) -> bool:
    # Cached: decode_step asks at every layer and step, and the scan cost ~2.5 us on this CPU.
    return any(rows == r and head_dim == d and dtype in dtypes for r, d, dtypes in BOUNDED_SHAPES)


def channels_per_lane(rows: int) -> int:
    """Value channels per lane at `rows` query rows per kv head (the kernel's CPL) at the
    current MAX_VALUE_SUMS."""
    return 16 if rows * 16 <= MAX_VALUE_SUMS else 8


_HELPERS = r"""
// Code j (B bits) of an aligned little-endian bit stream held in registers w[0..N): with j a
// compile-time constant after unrolling, the word index and the straddle are constants too.
template <int B, int N>
__device__ __forceinline__ unsigned vq_code(const uint32_t (&w)[N], int j) {
  const int bit = j * B;
  const int wi = bit >> 5;
  const int sh = bit & 31;
  unsigned v = w[wi] >> sh;
  if (sh + B > 32) v |= w[wi + 1] << (32 - sh);
  return v & ((1u << B) - 1u);
}
"""


def _header(max_value_sums: int) -> str:
    """The kernel's header at a value-sum budget. The budget is also a template argument of the
    launch (a function-scope constant of the same name, which takes precedence over this one):
    MLX's CUDA backend keys its compiled modules on the kernel's name and template arguments
    only, not on the header, so without it a second budget in one process would reuse the
    first one's module. This namespace-scope copy serves launches without that argument
    (tests/cache/cuda_emulation.py's older interface of this kernel)."""
    return kernel_header.HEADER + f"""
// The lane's R x CPL value sums stay under this many registers (channels_per_lane in Python).
constexpr int VQ_MAX_VALUE_SUMS = {max_value_sums};
""" + _HELPERS


_HEADER = _header(MAX_VALUE_SUMS)  # at the shipped budget

# This module's kernel text (rotated_partials_source.py), under the name every decode kernel
# module gives its own (the emulated tests' mutations and bench.batch_probe's variants patch it here).
_PARTIALS = rotated_partials_source.PARTIALS

_INPUTS = ["q", "ksg", "vsg", "kmean", "kc1", "ks1", "kz1", "kc2", "km2",
           "vc1", "vs1", "vz1", "vc2", "vm2", "wk", "wv", "sk", "sv", "meta", "wn"]


@lru_cache(maxsize=None)
def _partials_kernel(max_value_sums: int, min_blocks: int = 0):
    """The partials kernel at a value-sum budget and launch bounds (keyed on both: setting
    MAX_VALUE_SUMS or MIN_BLOCKS_PER_SM builds another kernel; the launch passes the budget as a
    template argument as well, and the bounds change the header, hence the kernel's name)."""
    header = _header(max_value_sums) + fused_decode.launch_bounds_header(min_blocks)
    return fused_decode.PartialsKernel("vq_rotated_decode_partials", _INPUTS, _PARTIALS, header)


def tokens_per_block(n_tokens: int, n_heads: int) -> int:
    """History tokens per block of 4 warps: 32-token tiles, enough warps to fill the GPU
    (TARGET_WARPS over all heads), at most MAX_TILES_PER_WARP tiles per warp."""
    return fused_decode.tokens_per_block(n_tokens, n_heads, TILE, MAX_TILES_PER_WARP, TARGET_WARPS)


def _shared_bytes(head_dim: int, value_dim: int, rows: int) -> int:
    # qx, qr, bias, per warp max(TILE, DV) x R floats, red_m / red_l
    per_warp = max(TILE, value_dim) * rows
    floats = 2 * head_dim * rows + rows + WARPS_PER_BLOCK * (per_warp + 2 * rows)
    return 4 * floats


def supports(head_dim: int, value_dim: int, key_stage1_bits: int, value_stage1_bits: int,
             rows: int) -> bool:
    """The shapes the kernel takes; others take the portable path. Dims: powers of two in
    32..256 (Hadamard, 32-channel key chunks, 16- or 8-channel value lanes, <= 32 lanes per value
    token); stage-1 bits 0..3 (turboquant_rvq's totals 1..4); 1..8 query rows per kv head
    (the lane's R x channels_per_lane(R) value sums); shared memory under 48 KB."""
    for d in (head_dim, value_dim):
        if d < 32 or d > 256 or d & (d - 1):
            return False
    if key_stage1_bits not in STAGE1_BITS or value_stage1_bits not in STAGE1_BITS:
        return False
    if not 1 <= rows <= MAX_ROWS:
        return False
    return _shared_bytes(head_dim, value_dim, rows) <= kernel_header.STATIC_SHARED_BYTES


def exact_sink(cache) -> tuple[mx.array, mx.array] | None:
    """The exact sink K/V (float32, (B, H, S, D) / (B, H, S, DV)): token 0's decoded codes plus
    the cache's deltas, derived once per sink (not state: rebuilt from the store when the
    deltas change, e.g. after a state load or a re-encoded first block), or None without one."""
    deltas = cache.sink_deltas
    if deltas is None:
        return None
    held = cache.__dict__.get("_exact_sink_cache")
    if held is None or held[0] is not deltas:
        s = deltas[0].shape[2]
        k_hat, v_hat = cache._reconstruct(cache.store, s)
        sink = ((k_hat + deltas[0]).astype(mx.float32), (v_hat + deltas[1]).astype(mx.float32))
        mx.eval(sink)
        held = (deltas, sink)
        cache._exact_sink_cache = held
    return held[1]


def store_arrays(cache) -> list[mx.array]:
    """(kc1, ks1, kz1, kc2, km2, vc1, vs1, vz1, vc2, vm2) from the cache's store: stage-1 arrays
    that do not exist (1-bit totals) are 1-element dummies the kernel never reads, a sign
    stage 1 passes its magnitudes as ks1 / vs1 and a dummy zero."""
    s = cache.store
    out = []
    for p, total in (("k", cache.key_bits), ("v", cache.value_bits)):
        b1 = total - 1
        if b1 == 0:
            absent = fused_decode.absent_input
            out += [absent(mx.uint32), absent(mx.float16), absent(mx.float16)]
        elif b1 == 1:
            out += [s[f"{p}_codes1"], s[f"{p}_scale1"], fused_decode.absent_input(mx.float16)]
        else:
            out += [s[f"{p}_codes1"], s[f"{p}_scales1"], s[f"{p}_zeros1"]]
        out += [s[f"{p}_codes2"], s[f"{p}_scale2"]]
    return out


def decode_step(cache, queries, scale: float):
    """A TurboQuantRVQCache decode step's attention through the kernel, or None where it is not
    active (off CUDA, switched off, a shape supports() refuses): the cache then takes the
    portable path."""
    if not fused_decode.kernels_enabled():
        return None
    kb1, vb1 = cache.key_bits - 1, cache.value_bits - 1
    budget = MAX_VALUE_SUMS  # read at each call: a probe sets it to time another lane split
    bounds = launch_bounds(queries.shape[1] // cache.n_kv_heads, cache.head_dim, queries.dtype)
    # The plan (fused_decode.planned_attend) holds while the sink corrections, the key mean and
    # the signs are the same objects too (each is replaced, never written in place).
    key = (id(cache.sink_deltas), id(cache.key_mean), id(cache._signs), budget)

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        if not supports(cache.head_dim, cache.value_dim, kb1, vb1, rows):
            return None
        meta_cache = cache.__dict__.setdefault("_rotated_meta", fused_decode.FusedDecodeMeta())
        return rotated_launch(
            queries, scale, cache._signs[0], cache._signs[1], cache.key_mean, store_arrays(cache),
            cache.window_keys, cache.window_values, exact_sink(cache),
            n_valid=cache.n_compressed, key_stage1_bits=kb1, value_stage1_bits=vb1,
            key_group=cache._group(cache.head_dim), value_group=cache._group(cache.value_dim),
            n_kv_heads=cache.n_kv_heads, meta_cache=meta_cache,
        )

    return fused_decode.planned_attend(cache, queries, scale, key, launch, lambda: _partials_kernel(budget, bounds))


# Where rotated_launch's input list holds the window (keys, values).
WINDOW_INPUTS = (_INPUTS.index("wk"), _INPUTS.index("wv"), _INPUTS.index("wn"))


def rotated_launch(
    queries, scale: float, key_signs, value_signs, key_mean, stores, window_keys, window_values,
    sink, *, n_valid: int, key_stage1_bits: int, value_stage1_bits: int, key_group: int,
    value_group: int, n_kv_heads: int, meta_cache: fused_decode.FusedDecodeMeta,
):
    """The launch of softmax(q K^T * scale) V for one query row per head, queries (B, Hq, 1, D),
    over the compressed tokens [S, n_valid) (S = sink tokens, attended exactly from `sink`), the
    sink and the exact window (B, H, W, D), W >= 1 -> (inputs, {template, n_blocks, heads,
    value_dim}, the window's input slots) for fused_decode.planned_attend (the output: (B, Hq,
    1, DV) in the queries' dtype). Only call when kernels_enabled() and supports(...):
    decode_step checks."""
    B, n_q_heads, _, D = queries.shape
    R = n_q_heads // n_kv_heads
    BH = B * n_kv_heads
    DV = window_values.shape[-1]
    n_sink = 0 if sink is None else sink[0].shape[2]
    absent = fused_decode.absent_input
    sk, sv = (absent(mx.float32), absent(mx.float32)) if sink is None else sink
    # The history blocks split the compressed tokens after the sink.
    per_block, n_hist_blocks, n_blocks = fused_decode.history_blocks(
        n_valid - n_sink, BH, "rotated fused decode", tokens_per_block)
    meta = meta_cache.get(n_valid, per_block, n_hist_blocks, float(scale), n_sink)
    dtype = queries.dtype
    budget = MAX_VALUE_SUMS  # read at each call: a probe sets it to time another lane split
    inputs = [queries, key_signs, value_signs, key_mean.astype(dtype), *stores,
              window_keys.astype(dtype), window_values.astype(dtype), sk, sv, meta,
              fused_decode.window_rows(window_keys.shape[2])]
    shape = {"template": [("D", D), ("DV", DV), ("R", R), ("KB1", key_stage1_bits),
                          ("VB1", value_stage1_bits), ("KG", key_group), ("VG", value_group), ("QT", dtype),
                          ("VQ_MAX_VALUE_SUMS", budget), ("WB", 0)],
             "n_blocks": n_blocks, "heads": BH, "value_dim": DV}
    return inputs, shape, WINDOW_INPUTS
