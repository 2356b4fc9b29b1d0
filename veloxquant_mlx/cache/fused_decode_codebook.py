"""A CUDA partials kernel for a decode step over KVQuant's layout (non-uniform codebooks, per-channel
key / per-token value normalization, sparse exact outliers, exact first-token sink).

Why: on the H200 KVQuant decoded at ~0.1x the fp16 cache's speed at 32K tokens through its
portable path (kvquant_attention.py: compiled chunked codebook lookups, several kernels and
a chunk of float32 levels per step). This kernel reads the packed codes once and produces the
flash-decoding partials (m, l, o) per block of history tokens plus one block for the exact part
(the sink and the window), which fused_decode.merge_partials merges, as kivi's kernels do
(fused_decode.py: its block split, tiles and merge are reused unchanged).

Layout read (what KVQuantCache stores, per block of G tokens and KV head):
  key_codes / value_codes (B, H, cap/G, W) uint32: the block's G*D codes, token-major (index
      t*D + c), packed by packing.pack_codes: 32 // bits codes per word, low bits first; for 3
      bits a word holds 10 codes (2 bits unused), so a token's codes need not start on a word;
  key_scale / key_zero (B, H, cap/G, D): per channel per block; value_scale / value_zero
      (B, H, cap): per token; element = level[code] * scale + zero;
  key_codebook / value_codebook (B, H, 2**bits) float32 levels;
  *_outlier_position (B, H, cap/G, N) uint16 (t*D + c in the block) and *_outlier_value
      (cache dtype): the exact entry replaces the element there (N may be 0: no arrays);
  token 0's codes are a placeholder: the kernel skips it (meta n_skip = 1) and attends the exact
      sink (sink_keys / sink_values, inputs of their own) in the exact block, before the window.

Work split (as fused_decode's kernel 1): blocks of 4 warps per (batch*KV head, range of history
tokens, a multiple of 512), one more block per head for the exact tokens; a warp walks tiles of
128 tokens.
  scores: lane i holds tokens 4i..4i+3 of the tile (one block of G, since G % 4 == 0), all R
      GQA rows at once: per pair of channels the lane reads its block's two scales and zeros
      in one load each (broadcast to the 8 lanes of the block), per channel the query's R
      entries from shared memory in one vector load, then per
      token extract + codebook lookup (shared) + one FMA to the key element + R FMAs. The key
      scale is not folded into the query: with 4 tokens per lane, folding (R products per
      channel for q*scale, R more for the zero sum) costs 2 operations per element at R = 4,
      the unfolded element FMA 1.
  key outliers: the raw scores go to the warp's shared tile, the lanes spread the tile's blocks'
      outliers over themselves and add q[c] * (exact - decoded) with shared atomics (several
      outliers may hit one token), then read the scores back. A lane takes OUTLIER_BATCH entries
      at a time, their loads issued together (session 11: at 128K on the H200 the outliers took
      0.17 of the kernel's 0.41 ms one entry at a time, 0.07 of 0.30 in batches of 4).
  probabilities: per token R floats in the warp's shared tile at slot i * 33 + lane (the lane's
      i-th token), one vector store per token without bank conflicts; the value loop's TPR
      (= 32 / LPT) tokens per read (slots 33 apart) fall in different banks.
  values: LPT = DV / CPL lanes share a token, CPL channels each (channels_per_lane: 16 halved
      while R x CPL exceeds MAX_LANE_ACCUMULATORS = 32: 8 at R = 3..4, 4 at R = 5..8; the old
      setting 64 gave 16 up to 4 rows, 8 above); the value scale is folded into the probability
      (p * scale, stored once per token) and the zero into one sum per row (sum p * zero,
      added to every channel at the end), so per element: extract + lookup + R FMAs.
  parked value sums (PARK_ACCUMULATORS, where parks()): a lane's R x CPL sums wait in shared
      memory (accs, slot (r * CPL + c) * 32 + lane: conflict-free) from the end of one tile's
      value loop to the start of the next's, rescaled by the tile's alpha as they are taken, so
      they hold no registers while a tile is scored (scores s[4][R], the 3-bit key path's words
      and phases, the side data in flight: the kernel's peak). Cost per tile and lane: 2 R CPL
      shared accesses (64 at R = 4) against the value loop's 128 / TPR rounds of R CPL FMAs,
      CPL lookups and R probability loads (~3500 instructions at R = 4): ~2% more instructions.
  value outliers: the lanes spread them as for the keys (in batches too) and add p * scale *
      ((exact - zero) / scale - level) into a per-warp (R, DV) correction buffer in shared memory (atomics),
      rescaled with the accumulators at every tile and added to the warp's partial at the end.
Codes: for 2 and 4 bits with D % (32 // bits) == 0 a token's codes are whole words and the
shifts are compile-time constants. For 3 bits (10 codes per word, 2 padding bits) a token's
codes (a lane's CPL value channels) start at a runtime phase inside a word, the same for each
run of 10 channels: per run the two words it spans are joined and shifted by the phase once
(vq_window: 4 integer operations per run and token), then its 10 codes are read at
compile-time shifts as in the aligned case.

Shared memory (4-byte floats): queries R*D, per warp a tile of R*max(132, D, DV) (scores, then
probabilities, then the warp's partial), with value outliers per warp R*DV corrections, parked
per warp R*CPL*32 value sums, two codebooks, per warp and row m and l. supports() counts it
against 48 KB unparked, parks() parked (35264 bytes for the default on the 8B shape, as ptxas
reports; unparked shared_bytes counts 16 bytes of stand-in that ptxas drops).

Registers per thread (ptxas of nvcc 13.0 for sm_90, -Xptxas -v; no spills anywhere; the shapes of
tests/cache/test_kernels_nvcc.py, default config: 3 bits, 1% outliers, G 32):
                       before session 5   MAX_LANE_ACCUMULATORS 32   32 + parked (default)
                       (64, unparked)     unparked
  bf16 R 4 d 128 (8B)        168                 128                        96
  fp16 R 8 d 128             219                 168                 168 (not parked: 54 KB)
  fp32 R 1 d 128             128                 128                        96
  bf16 R 3 d 64 (SmolLM2)    166                 141                        96
  8B shape at 2 / 4 bits   168 / 168          130 / 142                  80 / 80
The old split is MAX_LANE_ACCUMULATORS = 64 with PARK_ACCUMULATORS = False (those columns are
that setting compiled now). Without parking the 8B shape's peak is the 3-bit key path with the
R x 8 value sums live across it (ablations: 106 registers with that path cut). With 128 threads
per block an SM's 65536 registers hold 3 blocks (12 warps) at 168, 4 (16) at <= 128, 5 (20) at
<= 102; shared memory allows 5 at 35 KB. The 8B shape's grid at 32K tokens is 520 blocks (one
128-token tile per warp; ~3.9 per SM on 132 SMs: one wave from 4 resident blocks on, 1.3 at 3);
at 128K 2056 (one tile per warp, fused_decode.TARGET_WARPS 8192 since session 27; with 4096,
1032 blocks of two tiles, and past 128K ~690 of three: one wave at 5 blocks per SM plus a tail,
337 us a layer at 131584 tokens against 299 with 8192, results/lb_h200_s27_split_131584.json).
Timed on the H200 since (each run's command in results/README.md): the variants of session
11 (`kernel_probe_h200_s11_kvquant.json`, now `python -m veloxquant_mlx.bench.batch_probe`:
parking, value batches, outliers in batches), Nsight Compute at 128K in session 12
(`ncu_h200_s12.json`: 102 registers, 25% theoretical occupancy, ~7 cycles per issued
instruction), and the whole decode step against fp16's in every gpu_speed run since (session 19:
0.89x at 32K, 0.58x at 128K on a machine whose host bounds fp16's step,
`gpu_speed_h200_s19_*_all.json`). More resident warps per SM hide more of the code and
side-data loads' latency (kivi's kernel went 184 -> 104 registers and 0.092 -> 0.086 ms per
layer at 32K); against it, 16 lanes per value token (was 8) double the value loop's per-token
work per element (probability loads, code-word loads) and parking adds ~2%.

The kernel's CUDA text is in codebook_partials_source.py.
tests/cache/test_fused_decode_kvquant_emulated.py runs that source on the CPU under
tests/cache/cuda_emulation.py through KVQuantCache's decode path (each setting of the constants);
test_fused_decode_kvquant.py has the wiring test and the CUDA tests; test_fused_decode_kvquant_nvcc.py
(slow, nvcc) bounds the 8B shape's registers in each setting.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import codebook_partials_source, fused_decode, kernel_header
from veloxquant_mlx.cache.fused_decode import (
    PartialsKernel,
    WARPS_PER_BLOCK,
    FusedDecodeMeta,
)
from veloxquant_mlx.errors import QuantizerConfigError

SUPPORTED_BITS = (2, 3, 4)
TOKENS_PER_LANE = 4  # scoring: a lane's tokens, all inside one block of G
# values: a lane's channels of one token (lanes_per_token): MAX_CHANNELS_PER_LANE, halved while
# rows x channels exceeds MAX_LANE_ACCUMULATORS (the value sums a lane holds in registers).
# Session 5: 32 (8 channels at 3-4 rows; 168 -> 128 registers on the 8B shape, 96 parked). The old
# setting, 64 (16 channels up to 4 rows, 8 above: CHANNELS_PER_LANE {rows <= 4: 16, else 8}),
# is MAX_LANE_ACCUMULATORS = 64: set it to time both (the launch's LPT follows it).
MAX_LANE_ACCUMULATORS = 32
MAX_CHANNELS_PER_LANE = 16
MIN_CHANNELS_PER_LANE = 4
# PARK_ACCUMULATORS: a lane's value sums wait in shared memory (R x CPL floats per lane) while a
# tile is scored instead of holding registers across the whole tile loop, where shared memory
# allows (parks(): 48 KB with them). Session 5: on; before, off (the sums stayed in registers).
PARK_ACCUMULATORS = True
# UNALIGNED_VALUE_BATCH: where a lane's value codes start inside a word (3 bits: 10 codes per
# word), the value loop loads this many rounds' words before their arithmetic (a power of two;
# the template's UB). Before session 11 the loop took one round at a time (1): each round's two
# loads were waited on before its lookups and FMAs, 64 rounds per tile at the 8B shape.
UNALIGNED_VALUE_BATCH = 8
# OUTLIER_BATCH: outlier entries a lane takes at a time (the template's OB): their positions and
# exact values loaded together, then what the positions name (code word, scale, zero). Before
# session 11 (1) one entry at a time, two dependent loads waited on per entry; on the H200 the
# outliers then took 0.17 of kvquant's 0.41 ms per layer at 128K (results/kernel_probe_h200_s11_kvquant.json).
# 8 since session 12 (4 in session 11): in all three runs timing both on one machine, 8 took
# less at 32K tokens (0.0980 / 0.0878 / 0.0834 ms against 0.0997 / 0.0957 / 0.0970) and no more
# at 128K (0.296 / 0.297 / 0.299 against 0.304 / 0.302 / 0.300; results/kernel_probe_h200_s11_batches.json,
# results/batch_probe_h200_s12*.json). Registers (nvcc 13, the 8B shape): 96 -> 122, but the
# H200's nvrtc build of 4 already took 102 (Nsight Compute, results/ncu_h200_s12.json), i.e. 4
# blocks per SM, which 122 keeps.
OUTLIER_BATCH = 8
# KEY_SLOTS_BY_ROW: the key outliers' atomics on a row-major copy of the tile's scores (template
# KSL; key_slot in the source) instead of p_tile's token-major slots. Off: prepared in session 29
# after GEAR's kernel gained from the same layout, not yet timed on the H200 (batch_probe's
# kvquant variant `ksl`); emulated and nvcc-compiled both ways.
KEY_SLOTS_BY_ROW = False
MAX_ROWS = 8  # GQA rows per KV head
MAX_HEAD_DIM = 256

# This module's kernel text (codebook_partials_source.py, on the shared kernel_header.py), under
# the names every decode kernel module gives its own (the emulated tests' mutations and
# bench.batch_probe's variants patch them here).
_HEADER = kernel_header.HEADER
_PARTIALS = codebook_partials_source.PARTIALS
_WINDOW = codebook_partials_source.WINDOW

_INPUTS = ["q", "kc", "ks", "kz", "kcb", "vc", "vs", "vz", "vcb", "kop", "kov", "vop", "vov", "wk", "wv", "sk", "sv", "meta", "wn"]


@lru_cache(maxsize=None)
def _partials_kernel(lane_accumulators: int, park: bool, batches: tuple):
    """The partials kernel for a MAX_LANE_ACCUMULATORS / PARK_ACCUMULATORS / (UNALIGNED_VALUE_BATCH,
    OUTLIER_BATCH, KEY_SLOTS_BY_ROW) setting. The source does not read them (the lane split, the
    parking, the batches and the slots are the template's LPT, PARK, UB, OB and KSL, and MLX
    compiles one kernel per template),
    but a probe that changes a constant gets a kernel object of its own, never one built for the
    other setting."""
    return PartialsKernel("vq_codebook_decode_partials", _INPUTS, _PARTIALS, _HEADER + _WINDOW)


def channels_per_lane(rows: int) -> int:
    """A lane's value channels of one token: MAX_CHANNELS_PER_LANE, halved (down to
    MIN_CHANNELS_PER_LANE) while rows x channels exceeds MAX_LANE_ACCUMULATORS. At 32: 16
    channels for 1-2 rows, 8 for 3-4, 4 for 5-8; at 64 (the old setting): 16 up to 4 rows, 8
    above."""
    channels = MAX_CHANNELS_PER_LANE
    while rows * channels > MAX_LANE_ACCUMULATORS and channels > MIN_CHANNELS_PER_LANE:
        channels //= 2
    return channels


def lanes_per_token(value_dim: int, rows: int) -> int | None:
    """Lanes sharing one value token (channels_per_lane(rows) channels each), or None when
    that does not split the value head dim into a power of two up to 32 lanes."""
    channels = channels_per_lane(rows)
    lanes = value_dim // channels
    if value_dim % channels or lanes not in (1, 2, 4, 8, 16, 32):
        return None
    return lanes


def shared_bytes(head_dim: int, value_dim: int, rows: int, bits: int, value_outliers: bool,
                 parked: bool = False) -> int:
    """The kernel's static shared memory (4-byte floats), as declared in _PARTIALS; `parked`: with
    the lanes' value sums parked (accs: R x CPL floats per lane)."""
    widest = max(TOKENS_PER_LANE * 33, head_dim, value_dim)  # ps: SLOTS = 4 * 33 tokens' rows
    floats = rows * head_dim + WARPS_PER_BLOCK * widest * rows
    floats += WARPS_PER_BLOCK * (rows * value_dim if value_outliers else 1)
    floats += WARPS_PER_BLOCK * (rows * channels_per_lane(rows) * 32 if parked else 1)
    floats += 2 * (1 << bits) + 2 * WARPS_PER_BLOCK * rows
    return 4 * floats


def supports(head_dim: int, value_dim: int, group_size: int, bits: int, rows: int,
             value_outliers: bool = True) -> bool:
    """The shapes the kernel handles; others take the portable path: bits 2, 3, 4; groups of
    a multiple of 4 tokens (the config allows 32, 64, 128); 1..8 GQA rows; key head dims
    8..256, a multiple of 8 (channel pairs of side data per load), the value head dim 32, 64, 128 or 256 (the merge kernel reduces whole warps of
    channels), at most 4 rows above head dim 128; shared memory under 48 KB (the 8B shape,
    R = 4, D = DV = 128: 18.4 KB)."""
    if bits not in SUPPORTED_BITS or group_size % 4 or not 1 <= rows <= MAX_ROWS:
        return False
    if not 8 <= head_dim <= MAX_HEAD_DIM or head_dim % 8 or value_dim % 32 or lanes_per_token(value_dim, rows) is None:
        return False
    if max(head_dim, value_dim) > 128 and rows > 4:
        return False  # ptxas (sm_90) spilled at head dim 256 with 7 or 8 rows
    return shared_bytes(head_dim, value_dim, rows, bits, value_outliers) <= kernel_header.STATIC_SHARED_BYTES


def parks(head_dim: int, value_dim: int, rows: int, bits: int, value_outliers: bool) -> bool:
    """Whether the launch parks the value sums in shared memory: PARK_ACCUMULATORS and the
    kernel's shared memory with them under 48 KB (the 8B shape: 35 KB; not at 8 rows with value
    outliers: 54 KB, nor at head dim 256 with them)."""
    parked = shared_bytes(head_dim, value_dim, rows, bits, value_outliers, True)
    return PARK_ACCUMULATORS and parked <= kernel_header.STATIC_SHARED_BYTES


def _as(x: mx.array, dtype) -> mx.array:
    """x in dtype; x itself when it already is (no op in the step's graph)."""
    return x if x.dtype == dtype else x.astype(dtype)


def decode_step(cache, queries, scale: float):
    """A KVQuantCache decode step's attention through the kernel, or None where it is not active
    (off CUDA, switched off, a shape supports() refuses): the cache then takes the portable
    path. Token 0 of the history is the exact sink: skipped in the codes, attended from
    sink_keys / sink_values with the window."""
    if not fused_decode.kernels_enabled():
        return None
    # Read at each call (probes set them).
    batches = (UNALIGNED_VALUE_BATCH, OUTLIER_BATCH, KEY_SLOTS_BY_ROW)
    accumulators, park = MAX_LANE_ACCUMULATORS, PARK_ACCUMULATORS
    key = (accumulators, park, batches)  # beside planned_attend's own (the store's writes, the history...)

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        s = cache.store
        value_outliers = "value_outlier_position" in s
        if not supports(cache.head_dim, cache.value_dim, cache.group_size, cache.code_bits, rows, value_outliers):
            return None
        # The sink goes in as its own inputs, not concatenated with the window: two copies (two
        # more launches per layer and step) saved.
        sink = (s["sink_keys"], s["sink_values"]) if "sink_keys" in s else None
        meta_cache = cache.__dict__.setdefault("_codebook_meta", FusedDecodeMeta())
        _, inputs, shape = codebook_launch(
            queries, scale, s, cache.window_keys, cache.window_values, sink, n_valid=cache.n_compressed,
            group_size=cache.group_size, bits=cache.code_bits, n_kv_heads=cache.n_kv_heads,
            meta_cache=meta_cache, batches=batches,
        )
        return inputs, shape, WINDOW_INPUTS

    return fused_decode.planned_attend(cache, queries, scale, key, launch, lambda: _partials_kernel(accumulators, park, batches))


def codebook_decode_attention(
    queries, scale: float, store, window_keys, window_values, sink, *, n_valid: int,
    group_size: int, bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta,
):
    """softmax(q K^T * scale) V for one query row per head, queries (B, Hq, 1, D), over the
    compressed tokens [S, n_valid) read from `store` (KVQuantCache's arrays by name), the exact
    sink `sink` = (keys, values) (B, H, S, D) standing for tokens [0, S) (None: S = 0) and the
    exact window (B, H, W, D), W >= 1 -> (B, Hq, 1, DV) in the queries' dtype. Only call when
    kernels_enabled() and supports(...): decode_step checks."""
    return codebook_partials(
        queries, scale, store, window_keys, window_values, sink, n_valid=n_valid,
        group_size=group_size, bits=bits, n_kv_heads=n_kv_heads, meta_cache=meta_cache, merged=True,
    )


def codebook_partials(
    queries, scale: float, store, window_keys, window_values, sink, *, n_valid: int,
    group_size: int, bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, merged: bool = False,
):
    """The partials kernel's launch (checks, block split, meta, template) -> (part_o, part_m,
    part_l) for fused_decode.merge_partials, or with `merged` the attention output
    (PartialsKernel.attend: one launch, the merge fused in)."""
    kernel, inputs, shape = codebook_launch(
        queries, scale, store, window_keys, window_values, sink, n_valid=n_valid, group_size=group_size,
        bits=bits, n_kv_heads=n_kv_heads, meta_cache=meta_cache)
    if merged:
        return kernel.attend(queries, inputs=inputs, **shape)
    return kernel.partials(queries, inputs=inputs, **shape)


# Where codebook_launch's input list holds the window (keys, values).
WINDOW_INPUTS = (_INPUTS.index("wk"), _INPUTS.index("wv"), _INPUTS.index("wn"))


def codebook_launch(
    queries, scale: float, store, window_keys, window_values, sink, *, n_valid: int,
    group_size: int, bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, batches: tuple | None = None,
):
    """The checks, block split, meta and template of the partials kernel's launch ->
    (kernel, inputs, {template, n_blocks, heads, value_dim}). `batches`: (UNALIGNED_VALUE_BATCH,
    OUTLIER_BATCH, KEY_SLOTS_BY_ROW) as the caller read them for its launch plan's key (None:
    read here), so the
    plan, the kernel object and the template take one reading."""
    B, n_q_heads, _, D = queries.shape
    R = n_q_heads // n_kv_heads
    BH = B * n_kv_heads
    DV = window_values.shape[-1]
    side = store["key_scale"].dtype
    skip = 0 if sink is None else sink[0].shape[2]
    sink_keys, sink_values = (fused_decode.absent_input(side), fused_decode.absent_input(side)) if sink is None else sink
    if n_valid % group_size:
        raise QuantizerConfigError(
            f"codebook fused decode: {n_valid} history tokens is invalid: allowed is a multiple "
            f"of the group size {group_size} (whole blocks)"
        )
    fused_decode.check_skip(skip, n_valid, "codebook fused decode")
    per_block, n_hist_blocks, n_blocks = fused_decode.history_blocks(n_valid, BH, "codebook fused decode")
    outliers = []
    counts = []
    for prefix in ("key", "value"):
        if f"{prefix}_outlier_position" in store:
            outliers += [store[f"{prefix}_outlier_position"], store[f"{prefix}_outlier_value"]]
            counts.append(store[f"{prefix}_outlier_position"].shape[-1])
        else:
            outliers += [fused_decode.absent_input(mx.uint16), fused_decode.absent_input(side)]
            counts.append(0)
    meta = meta_cache.get(n_valid, per_block, n_hist_blocks, float(scale), skip)
    dtype = queries.dtype
    park = parks(D, DV, R, bits, counts[1] > 0)
    ub, ob, ksl = (UNALIGNED_VALUE_BATCH, OUTLIER_BATCH, KEY_SLOTS_BY_ROW) if batches is None else batches
    kernel = _partials_kernel(MAX_LANE_ACCUMULATORS, PARK_ACCUMULATORS, (ub, ob, ksl))
    inputs = [queries, store["key_codes"], store["key_scale"], store["key_zero"],
              _as(store["key_codebook"], mx.float32), store["value_codes"], store["value_scale"],
              store["value_zero"], _as(store["value_codebook"], mx.float32), *outliers,
              _as(window_keys, dtype), _as(window_values, dtype), sink_keys, sink_values, meta,
              fused_decode.window_rows(window_keys.shape[2])]
    template = [("D", D), ("DV", DV), ("R", R), ("G", group_size), ("BITS", bits),
                ("LPT", lanes_per_token(DV, R)), ("NOK", counts[0]), ("NOV", counts[1]), ("PARK", park),
                ("UB", ub), ("OB", ob), ("KSL", int(ksl)),
                ("QT", dtype), ("ST", side), ("WB", 0)]
    return kernel, inputs, {"template": template, "n_blocks": n_blocks, "heads": BH, "value_dim": DV}
