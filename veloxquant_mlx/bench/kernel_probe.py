"""Where the CUDA decode kernel's time goes, and a prefill's pieces (MLX's CUDA backend only).

    python -m veloxquant_mlx.bench.kernel_probe --parts read,decode,prefill --out X.json

One layer of the 8B shape (32 query / 8 KV heads, head_dim 128, bf16), kivi-2 (group 32):
- `read`: a read-only kernel over 2-bit K^T codes of 128K tokens (33.5 MB per layer), in the
  store's layout (each warp reads 32 bytes of each of the 128 channel rows of a 128-token tile)
  and in a tile-major layout (the same bytes contiguous): GB/s of each. Tells whether the key
  layout bounds the decode kernel.
- `decode`: at each of `--contexts`, ms per call (calls enqueued back to back, their graphs built
  before the clock starts, one eval; median of 5 batches) of the fp16 `mx.fast` attention (its
  calls independent, and chained: each after the last, as kivi's whole `cache.attention` runs),
  kivi's whole `cache.attention`, the shipped launch with the merge fused in (`fused_full`), and
  cache/fused_decode.py's partials kernel alone as shipped ("full"), with the value half removed
  ("noscore" keeps values and the softmax, "novalue" keeps the scores, "noscore+novalue" only
  what they share), without the exact block's tokens ("nowindow") or with only them
  ("windowonly": which part ends the launch), with the exact block's rows read 16 bytes a load
  (`fused_decode.WINDOW_ROW_VECTORS`, off as shipped: "full_row_vectors", and the fused launch
  "fused_full_row_vectors"), with the history's scores on tensor cores
  (`fused_decode.MMA_SCORES`, off as shipped: "full_mma", "fused_full_mma"), the fused launch
  chained (each call after the last, as a model's layers run: "fused_chain_warps1024/2048/4096",
  "fused_chain_mma"), with its value loop unrolled whole as before session 9 ("unrolled";
  the variants "u2f" and "unit", codes turned into floats without the conversion instruction, are
  built by `variant_source` but not timed by default: session 9 found them no faster), with other warp
  targets (`AFFINE_TARGET_WARPS`) and with other value accumulators per lane (`MAX_LANE_ACCUMULATORS`
  64 / 16 beside the default 32: at 4 rows 8 / 16 lanes per value token; fewer accumulators,
  fewer registers, more warps per SM).
- `prefill`: one layer's 32K prompt in 2048-token chunks for the fp16 KVCache with `mx.fast`
  attention and for each of `--methods` (update + attention; two fills each, the first paying
  the JIT compiles of every history length), then for ours the pieces of one more chunk's
  attention: building the history's K/V for the fused attention (`_prefill_keys_values`), the
  fused attention over it, and encoding one chunk (`_encode`; None for minicache, whose pair
  encodes).
- `step`: at each of `--contexts`, one layer's whole decode step for each of `--methods` (the
  new token's update plus the attention; the fp16 KVCache with mlx-lm's attention), 30 steps
  enqueued per eval so block flushes are amortised as in generation, their graphs built before
  the clock starts (the device's time per step); and for kivi the pieces
  outside its partials kernel (the merge kernel; and the exact sink's two concatenations, which
  the step paid until the sink became the partials kernel's own inputs sk / sv: a reference
  for the saving, no longer part of the step). Tells
  the fixed per-step cost apart from the kernel's per-token cost (short contexts show it).
The probe runs as cases (`read`; `decode` per context; `prefill` per spec, fp16 first; `step`
per context and spec), each printed with its time on stderr as it finishes and recorded in the
JSON's `cases` (done / error / skipped, seconds); `--out` is rewritten after every case, so a
device call's `timeout` keeps what was measured (session 6: four calls under timeouts of 60-110 s
each ran out and left nothing, the file being written only at the end). `--budget-s` starts no
new case after that many seconds (recorded as skipped); a failing case records its error and the
next one runs.
`--set MODULE.NAME=VALUE` sets an integer or boolean constant of a cache module first
(bench/constants.py: a kernel's register budget, say), so two runs time two settings.
The kernel variants are derived from the shipped source by cutting marked spans: a change to
that source that moves the markers fails loudly (`variant_source`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

MODULE = "veloxquant_mlx.bench.kernel_probe"
PARTS = ("read", "decode", "prefill", "step")
HQ, HK, D = 32, 8, 128

# Spans of fused_decode._PARTIALS cut out for the variants: (start marker, end marker), the
# start's "} else {" branch replaced by a closing brace.
_CUTS = {
    "noscore": ("    } else {\n      // Past-the-end lanes read", "    // ---- online softmax"),
    "novalue": ("    } else {\n      // The tile's values staged", "    __syncwarp();\n  }\n\n  float* red_o"),
}

# The partials kernel's line that ends each block's tokens (the exact block's: sink + window).
_LAST = "const int last = window ? n_sink + (WB ? wn_shape[0] : n_window) : min(first + per_block, n_valid);"

# Text substitutions of fused_decode._PARTIALS for the variants that change how codes become
# floats: "u2f" by the 2^23 mantissa trick (vq_u2f: a logic op and a subtraction) instead of an
# int-to-float conversion; "unit" as 1 + code / 2^bits (the code or-ed into the mantissa of 1.0,
# the scale and zero rescaled per channel / token so the dequantizing FMA takes it as is).
_SUBS = {
    # the history's value loop unrolled whole, as before session 9 (~74 KB of code at the 8B shape)
    "unrolled": (
        ("#pragma unroll 1\n        for (int b0 = 0; b0 < VST / TPR; b0 += BATCH) {",
         "#pragma unroll\n        for (int b0 = 0; b0 < VST / TPR; b0 += BATCH) {"),
    ),
    # The exact block (sink and window: one block per head, its rows read from global memory one
    # token per lane) or the history blocks left with no tokens: which of the two ends the
    # launch. Why: Nsight (results/ncu_full_s21_kivi_decode.csv, 32K) has the SMs active 73 K of
    # the launch's 125 K cycles on average, a tail that a few long blocks would make.
    "nowindow": ((_LAST, _LAST.replace("window ? n_sink + (WB ? wn_shape[0] : n_window) :", "window ? 0 :")),),
    "windowonly": ((_LAST, _LAST.replace("min(first + per_block, n_valid);", "first;")),),
    "u2f": (
        ("(float)((w >> (i * KB)) & ((1u << KB) - 1u))", "vq_u2f((w >> (i * KB)) & ((1u << KB) - 1u))"),
        ("fmaf(sc[k], (float)code, zp[k])", "fmaf(sc[k], vq_u2f(code), zp[k])"),
    ),
    "unit": (
        ("const float sc = vq_f32(kss[dd * NGK + g]);\n          const float zp = vq_f32(kzs[dd * NGK + g]);",
         "const float sc = vq_f32(kss[dd * NGK + g]) * (float)(1u << KB);\n          const float zp = vq_f32(kzs[dd * NGK + g]) - sc;"),
        ("(float)((w >> (i * KB)) & ((1u << KB) - 1u))",
         "__uint_as_float((((w >> (i * KB)) & ((1u << KB) - 1u)) << (23 - KB)) | 0x3F800000u)"),
        ("for (int i = 0; i < WPL; ++i) words[k][i] = row[i];", "for (int i = 0; i < WPL; ++i) words[k][i] = row[i] >> sub;"),
        ("sc[k] = vq_f32(vss[tj * GV + ch0 / G]);\n            zp[k] = vq_f32(vzs[tj * GV + ch0 / G]);",
         "sc[k] = vq_f32(vss[tj * GV + ch0 / G]) * (float)(1u << VB);\n            zp[k] = vq_f32(vzs[tj * GV + ch0 / G]) - sc[k];"),
        ("(((c * VB) & 31) + sub)) & ((1u << VB) - 1u);", "((c * VB) & 31)) & ((1u << VB) - 1u);"),
        ("fmaf(sc[k], (float)code, zp[k])", "fmaf(sc[k], __uint_as_float((code << (23 - VB)) | 0x3F800000u), zp[k])"),
    ),
}

READ_SOURCE = r"""
  // MODE 0: K^T rows (the store's layout), a warp reads 32 bytes of each of 128 rows per tile.
  // MODE 1: tile-major, the tile's 8 * 128 words contiguous, 128 bytes per warp instruction.
  const int lane = threadIdx.x % 32;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int bh = blockIdx.y;
  const int words = kc_shape[2];
  const int tiles = words / 8;
  unsigned acc = 0;
  for (int t = warp; t < tiles; t += gridDim.x * blockDim.x / 32) {
    if (MODE == 0) {
      const uint32_t* col = kc + (size_t)bh * 128 * words + t * 8 + lane / 4;
      #pragma unroll 16
      for (int d = 0; d < 128; ++d) acc += __ldg(col + (size_t)d * words);
    } else {
      const uint32_t* tile = kc + ((size_t)bh * tiles + t) * 128 * 8;
      #pragma unroll
      for (int i = 0; i < 32; ++i) acc += __ldg(tile + i * 32 + lane);
    }
  }
  out[(size_t)bh * gridDim.x * blockDim.x + blockIdx.x * blockDim.x + threadIdx.x] = acc;
"""


def parse_args(argv=None):
    from veloxquant_mlx.bench import constants
    from veloxquant_mlx.bench.command import parser

    p = parser(MODULE, __doc__)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--contexts", default="32768,131072", help="decode contexts (default 32768,131072)")
    p.add_argument("--methods", default="fp16,kivi,xquant,turboquant_rvq",
                   help="cache specs of the `step` and `prefill` parts, as for `veloxquant bench` (default fp16,kivi,xquant,turboquant_rvq)")
    p.add_argument("--prefill-context", type=int, default=32768,
                   help="the `prefill` part's prompt length (default 32768)")
    p.add_argument("--fills", type=int, default=2,
                   help="fills per cache in the `prefill` part (default 2: cold, then warm)")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="the `prefill` part's chunk (default 2048, mlx-lm's prefill step)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new case after this many seconds (recorded as skipped); set it "
                        "below the device call's timeout so the JSON is complete up to there")
    constants.add_set_option(p)
    args = p.parse_args(argv)
    args.set = constants.parsed_settings(p, args.set)
    if args.fills < 1 or args.prefill_chunk < 1 or args.prefill_context < args.prefill_chunk:
        p.error(f"--fills {args.fills} / --prefill-chunk {args.prefill_chunk} / --prefill-context "
                f"{args.prefill_context}: allowed are fills >= 1, a chunk >= 1 and a context of at "
                "least one chunk")
    args.parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        p.error(f"--parts {','.join(unknown)}: allowed are {', '.join(PARTS)}")
    args.contexts = [int(x) for x in args.contexts.split(",") if x]
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec

    try:
        args.specs = [parse_layer_spec(x) for x in args.methods.split(",") if x]
    except ValueError as exc:
        p.error(f"--methods: {exc}")
    return args


def variant_source(mode: str) -> str:
    """fused_decode's partials source, whole ("full"), with halves cut out (_CUTS, joined by
    "+": "noscore+novalue" keeps only what the two halves share) or with substitutions (_SUBS)."""
    from veloxquant_mlx.cache import fused_decode

    source = fused_decode._PARTIALS
    if mode == "full":
        return source
    if mode in _SUBS:
        for old, new in _SUBS[mode]:
            if source.count(old) != 1:
                raise ValueError(f"variant {mode!r}: fused_decode._PARTIALS no longer has {old!r}; update _SUBS")
            source = source.replace(old, new)
        return source
    for part in mode.split("+"):
        if part not in _CUTS:
            raise ValueError(f"variant {mode!r}: allowed are full, {', '.join(_SUBS)}, or of {', '.join(_CUTS)} joined by +")
        start, end = _CUTS[part]
        if source.count(start) != 1 or source.count(end) != 1 or source.index(start) > source.index(end):
            raise ValueError(f"variant {mode!r}: fused_decode._PARTIALS no longer has its markers; update _CUTS")
        source = source[: source.index(start)] + "    }\n" + source[source.index(end):]
    return source


def variant_kernel(mode: str):
    """The partials kernel built from variant_source(mode), under its own name."""
    import mlx.core as mx

    from veloxquant_mlx.cache import fused_decode as fd
    from veloxquant_mlx.cache.kernel_name import build_kernel

    return build_kernel(
        mx.fast.cuda_kernel, name=f"vq_probe_{mode.replace('+', '_')}", input_names=list(fd.PARTIALS_INPUTS),
        output_names=["part_o", "part_m", "part_l"], source=variant_source(mode), header=fd._HEADER)


# Calls per batch of per_call_ms, and so the fused launch's probe's launch states (_partials_call).
CALLS_PER_BATCH = 30


def per_call_ms(fn, calls: int = CALLS_PER_BATCH, batches: int = 5, build_untimed: bool = False) -> float:
    """Median over `batches` of the ms per call of `calls` calls enqueued then evaluated once.
    `build_untimed`: the calls' graphs are built before the clock starts, so only the device's
    work is timed (in generation the host builds the next step while the device runs this one)."""
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(batches):
        if build_untimed:
            outs = [fn() for _ in range(calls)]
            start = time.perf_counter()
            mx.eval(outs)
        else:
            start = time.perf_counter()
            mx.eval([fn() for _ in range(calls)])
        times.append((time.perf_counter() - start) / calls * 1e3)
    return sorted(times)[len(times) // 2]


def _filled_kivi(n: int):
    """A kivi-2 cache holding n random bf16 tokens as a prefill leaves it plus one decode
    token (bench.attention's preparation), its K/V and a query row per head."""
    import mlx.core as mx

    from veloxquant_mlx.bench.attention import prepared_call
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec

    mx.random.seed(0)
    k = mx.random.normal((1, HK, n, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, HK, n, D)).astype(mx.bfloat16)
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    cache, attend = prepared_call(parse_layer_spec("kivi"), q, k, v, D**-0.5)
    return cache, attend, k, v, q


def _partials_call(kernel, cache, q, target_warps: int, lane_accumulators: int | None = None,
                   merged: bool = False, row_vectors: int | None = None, mma: int | None = None,
                   chained: bool = False):
    """The partials kernel `kernel` alone -> (part_o, part_m, part_l), launched as the shipped
    decode step launches it (fused_decode.affine_partials) with AFFINE_TARGET_WARPS set to
    `target_warps` (and MAX_LANE_ACCUMULATORS to `lane_accumulators` if given: more lanes per
    value token, fewer registers; WINDOW_ROW_VECTORS to `row_vectors` and MMA_SCORES to `mma`
    if given; a variant `kernel` of the source runs its FMA loops, the ones its cuts name: no
    tensor-core values, tensor-core scores only where `mma` is 1); the sink is
    attended from its placeholder codes (skip 0, window alone). `merged` (kernel None): the shipped build with the merge fused in -> the
    attention output; successive calls take the launch states of a pool in turn (one per call
    of a per_call_ms batch, CALLS_PER_BATCH), so the calls of a batch share no counters (they stay
    as independent as the split build's) and none pays a new state's zero fills (at 128K its
    scratch is ~17 MB: before session 10's pool every call filled a new one). `chained` (with
    `merged`): one launch state for every call, so each launch follows the last (its `after`
    input), as a model's layers run them: its ramp, slowest SM and merge are then not hidden
    behind the next call's blocks, as they are between independent launches."""
    from veloxquant_mlx.cache import fused_decode as fd

    s = cache.store
    arrays = [s[name] for name in ("key_codes", "key_scales", "key_biases", "value_codes",
                                   "value_scales", "value_biases")]
    meta = fd.FusedDecodeMeta()
    states = [fd.FusedLaunchState() for _ in range(1 if chained else CALLS_PER_BATCH)] if merged else [None]
    turn = [0]

    def call():
        saved = (fd.AFFINE_TARGET_WARPS, fd.MAX_LANE_ACCUMULATORS, fd.MAX_LANES_PER_TOKEN, fd.WINDOW_ROW_VECTORS,
                 fd.MMA_SCORES)
        fd.AFFINE_TARGET_WARPS = target_warps
        if mma is not None:
            fd.MMA_SCORES = mma
        if lane_accumulators is not None:
            fd.MAX_LANE_ACCUMULATORS, fd.MAX_LANES_PER_TOKEN = lane_accumulators, 32
        if row_vectors is not None:
            fd.WINDOW_ROW_VECTORS = row_vectors
        try:
            return fd.affine_partials(
                q, D**-0.5, *arrays, cache.window_keys, cache.window_values,
                n_valid=cache.n_compressed, group_size=cache.group_size, key_bits=cache.key_bits,
                value_bits=cache.value_bits, n_kv_heads=HK, meta_cache=meta, kernel=kernel, merged=merged,
                state=states[turn[0] % len(states)],
                score_mma=None if kernel is None else bool(mma), value_mma=None if kernel is None else False)
        finally:
            turn[0] += 1
            (fd.AFFINE_TARGET_WARPS, fd.MAX_LANE_ACCUMULATORS, fd.MAX_LANES_PER_TOKEN, fd.WINDOW_ROW_VECTORS,
             fd.MMA_SCORES) = saved

    return call


def probe_read(n: int = 131072) -> dict:
    import mlx.core as mx

    words = n * 2 // 32
    codes = mx.random.randint(0, 2**31, (HK, 128, words)).astype(mx.uint32)
    mx.eval(codes)
    kernel = mx.fast.cuda_kernel(name="vq_probe_read", input_names=["kc"], output_names=["out"],
                                 source=READ_SOURCE)
    out = {"tokens": n, "bytes": int(codes.nbytes)}
    for mode, layout in ((0, "kt_rows"), (1, "tile_major")):
        for blocks in (264, 1056):
            call = lambda mode=mode, blocks=blocks: kernel(  # noqa: E731
                inputs=[codes], template=[("MODE", mode)], grid=(128 * blocks, HK, 1),
                threadgroup=(128, 1, 1), output_shapes=[(HK * blocks * 128,)], output_dtypes=[mx.uint32])[0]
            ms = per_call_ms(call)
            out[f"{layout}_blocks{blocks}"] = {"ms": ms, "GB_per_s": codes.nbytes / ms / 1e6}
    return out


def probe_decode(n: int) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.cache import fused_decode as fd

    cache, attend, k, v, q = _filled_kivi(n)
    # Graphs built before the clock (build_untimed): the figures are the device's time per call
    # (or the launches', where a call is shorter). Before session 9's last commit they included
    # building the graph on the host, which at 32K was most of a call (the variant without
    # either loop took 0.058-0.067 ms at 32K as at 128K: results/kernel_probe_h200_s9_rolled_*.json).
    def timed(fn):
        return per_call_ms(fn, build_untimed=True)

    out = {
        "fp16_sdpa_ms": timed(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5)),
        # Each call after the last, as a model's layers run them (kivi's attention is chained by
        # its launch state): the comparison for kivi_attention_ms.
        "fp16_sdpa_chain_ms": timed(_chained(lambda qc: mx.fast.scaled_dot_product_attention(qc, k, v, scale=D**-0.5), q)),
        "kivi_attention_ms": timed(attend),
        "history_bytes": int(sum(a.nbytes for a in cache.store.values()) * cache.n_compressed / cache.capacity),
        # the shipped launch: partials with the merge fused in (vs partials_full: the split build)
        "fused_full_ms": timed(_partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS, merged=True)),
    }
    for mode in ("full", "noscore", "novalue", "noscore+novalue", "unrolled", "nowindow", "windowonly"):
        kernel = variant_kernel(mode)
        targets = (fd.AFFINE_TARGET_WARPS, 4096, 16384) if mode == "full" else (fd.AFFINE_TARGET_WARPS,)
        for warps in targets:
            out[f"partials_{mode}_warps{warps}_ms"] = timed(_partials_call(kernel, cache, q, warps))
    # The exact block's rows 16 bytes a load (WINDOW_ROW_VECTORS), split build and fused launch.
    out["partials_full_row_vectors_ms"] = timed(_partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS, row_vectors=1))
    out["fused_full_row_vectors_ms"] = timed(_partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS, merged=True, row_vectors=1))
    # The history's scores on tensor cores (MMA_SCORES), split build and fused launch.
    out["partials_full_mma_ms"] = timed(_partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS, mma=1))
    out["fused_full_mma_ms"] = timed(_partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS, merged=True, mma=1))
    # Each fused launch after the last (one launch state), as a model's layers run them: the
    # figure that set AFFINE_TARGET_WARPS (session 22, measured then through the whole
    # attention: bench.launch_bounds_probe), per target, and with MMA.
    for warps in (1024, 2048, 4096):
        out[f"fused_chain_warps{warps}_ms"] = timed(_partials_call(None, cache, q, warps, merged=True, chained=True))
    out["fused_chain_mma_ms"] = timed(_partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS, merged=True, mma=1,
                                                     chained=True))
    for lanes_acc in (64, 16):  # the former default (16 channels per lane at 4 rows), and fewer
        out[f"partials_full_lane_accumulators{lanes_acc}_ms"] = timed(
            _partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS, lanes_acc))
    return out


def _chained(fn, q):
    """fn(q) per call, each call's query made to depend on the last call's output (mx.depends:
    no arithmetic), so the device runs the calls one after another."""
    import mlx.core as mx

    last = [None]

    def call():
        qc = q if last[0] is None else mx.depends([q], [last[0]])[0]
        last[0] = fn(qc)
        return last[0]
    return call


def prefill_inputs(n: int):
    """One layer's bf16 K, V and queries of n tokens (seeded: every spec sees the same)."""
    import mlx.core as mx

    mx.random.seed(1)
    k = mx.random.normal((1, HK, n, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, HK, n, D)).astype(mx.bfloat16)
    q = mx.random.normal((1, HQ, n, D)).astype(mx.bfloat16)
    mx.eval(k, v, q)
    return k, v, q


def prefill_step(cache, k, v, q, part: slice, mask="causal") -> None:
    """One prefill chunk of one layer, evaluated: `part` of k / v appended, its queries attended
    (`cache.attention` for ours, mlx-lm's SDPA call for the fp16 KVCache) under `mask` (None: a
    decode step's, as mlx-lm passes for one token), the cache's arrays evaluated with the output."""
    import mlx.core as mx

    from veloxquant_mlx.bench.drive import cache_arrays
    from veloxquant_mlx.cache.base import CompressedKVCache

    keys, values = cache.update_and_fetch(k[:, :, part], v[:, :, part])
    if isinstance(cache, CompressedKVCache):
        att = cache.attention(q[:, :, part], scale=D**-0.5, mask=mask)
    else:
        att = mx.fast.scaled_dot_product_attention(q[:, :, part], keys, values, scale=D**-0.5, mask=mask)
    mx.eval(att, cache_arrays([cache]))


def probe_prefill_spec(spec, k, v, q, chunk: int = 2048, fills: int = 2) -> dict:
    """One spec's prefill of k/v/q in `chunk`-token chunks, `fills` times (the first paying the
    JIT compiles of every history length) -> {"fills": [s, ...]}, and for ours the pieces of one
    more chunk's attention in "last_chunk_ms": building the history's K/V for the fused
    attention, that attention, and encoding one chunk (ms, device time)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from veloxquant_mlx.cache.base import CompressedKVCache

    n = k.shape[2]
    out = {"fills": []}
    for _ in range(fills):
        cache = spec.make()
        ours = isinstance(cache, CompressedKVCache)
        start = time.perf_counter()
        for s0 in range(0, n, chunk):
            prefill_step(cache, k, v, q, slice(s0, s0 + chunk))
        out["fills"].append(time.perf_counter() - start)
    if not ours:
        return out
    rows = q[:, :, -chunk:]
    keys, values = cache._prefill_keys_values(rows)
    mx.eval(keys, values)
    pieces = {
        "history_keys_values": per_call_ms(lambda: cache._prefill_keys_values(rows), calls=5, batches=3),
        "fused_attention": per_call_ms(lambda: mx.fast.scaled_dot_product_attention(
            rows, keys, values, scale=D**-0.5, mask="causal"), calls=5, batches=3),
    }
    try:
        pieces["encode_one_chunk"] = per_call_ms(
            lambda: tree_flatten(cache._encode(k[:, :, -chunk:], v[:, :, -chunk:])), calls=5, batches=3)
    except NotImplementedError:
        # minicache's layers are encoded by their pair, in the upper layer's flush.
        pieces["encode_one_chunk"] = None
    out["last_chunk_ms"] = pieces
    return out


def _prefill_order(specs) -> list:
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec

    return [parse_layer_spec("fp16")] + [s for s in specs if s.name != "fp16"]


def probe_prefill(specs, n: int = 32768, chunk: int = 2048, fills: int = 2) -> dict:
    """fp16 and each of `specs` (probe_prefill_spec), in one dict: {"tokens", "chunk", "fills":
    {spec: [s, ...]}, "last_chunk_ms": {spec: pieces}} (the shape `run` writes case by case)."""
    k, v, q = prefill_inputs(n)
    out = {"tokens": n, "chunk": chunk, "fills": {}, "last_chunk_ms": {}}
    for spec in _prefill_order(specs):
        _put_prefill(out, spec.name, probe_prefill_spec(spec, k, v, q, chunk, fills))
    return out


def _put_prefill(row: dict, name: str, got: dict) -> None:
    row["fills"][name] = got["fills"]
    if "last_chunk_ms" in got:
        row["last_chunk_ms"][name] = got["last_chunk_ms"]


def step_inputs(n: int):
    """A layer's bf16 K/V history of n tokens, a query row per head and the new token's K/V."""
    import mlx.core as mx

    mx.random.seed(2)
    k = mx.random.normal((1, HK, n, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, HK, n, D)).astype(mx.bfloat16)
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    new = mx.random.normal((1, HK, 1, D)).astype(mx.bfloat16)
    mx.eval(k, v, q, new)
    return k, v, q, new


def probe_step_spec(spec, k, v, q, new) -> dict:
    """ms per decode step of one layer (update + attention) for `spec` over the history k/v
    ("{name}_step_ms"), and for kivi the pieces outside its partials kernel."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    from veloxquant_mlx.bench.drive import cache_arrays
    from veloxquant_mlx.cache import fused_decode as fd
    from veloxquant_mlx.cache.base import CompressedKVCache

    out = {}
    cache = spec.make()
    ours = isinstance(cache, CompressedKVCache)
    cache.update_and_fetch(k, v)
    if ours:
        cache.attention(q, scale=D**-0.5)  # flushes as a prefill leaves it
    mx.eval(cache_arrays([cache]))

    def step():
        keys, values = cache.update_and_fetch(new, new)
        if ours:
            return cache.attention(q, scale=D**-0.5)
        return scaled_dot_product_attention(q, keys, values, cache=cache, scale=D**-0.5, mask=None)

    # Few batches: every step grows the cache by one token. Graphs built untimed: the device's
    # time per step (results/kernel_probe_step_h200_s4.json predates this and includes the
    # host's graph building, serial there).
    out[f"{spec.name}_step_ms"] = per_call_ms(step, calls=30, batches=3, build_untimed=True)
    if spec.name == "kivi" and cache.sink_keys is not None:
        wk, wv = cache.window_keys, cache.window_values
        out["kivi_sink_concat_ms"] = per_call_ms(lambda: [
            mx.concatenate([cache.sink_keys, wk], axis=2), mx.concatenate([cache.sink_values, wv], axis=2)])
        parts = _partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS)()
        mx.eval(parts)
        out["kivi_partials_ms"] = per_call_ms(_partials_call(None, cache, q, fd.AFFINE_TARGET_WARPS))
        out["kivi_merge_ms"] = per_call_ms(lambda: fd.merge_partials(*parts, q))
    return out


def probe_step(n: int, specs) -> dict:
    """probe_step_spec for each of `specs` at context n, in one dict."""
    k, v, q, new = step_inputs(n)
    out = {}
    for spec in specs:
        out.update(probe_step_spec(spec, k, v, q, new))
    return out


@dataclass
class Case:
    """One timed unit of the probe: `measure()` -> a value that `put(rows, value)` files into
    the result's rows (the part's layout, as older files hold it)."""
    name: str
    measure: Callable[[], object]
    put: Callable[[dict, object], None]


def _one_input(make):
    """make(n) memoised for the latest n only (inputs of 128K tokens are a GiB: keep one)."""
    held: dict = {}

    def get(n):
        if n not in held:
            held.clear()
            held[n] = make(n)
        return held[n]

    return get


def build_cases(args) -> list[Case]:
    """The probe's cases in run order: read; decode per context; prefill per spec (fp16
    first); step per context and spec."""
    cases = []

    def setter(*path):
        def put(rows, value):
            node = rows
            for key in path[:-1]:
                node = node.setdefault(key, {})
            if isinstance(value, dict) and isinstance(node.get(path[-1]), dict):
                node[path[-1]].update(value)
            else:
                node[path[-1]] = value
        return put

    if "read" in args.parts:
        cases.append(Case("read", probe_read, setter("read")))
    for n in args.contexts if "decode" in args.parts else []:
        cases.append(Case(f"decode {n}", lambda n=n: probe_decode(n), setter("decode", str(n))))
    if "prefill" in args.parts:
        # Names of their own (tokens, not n): the lambdas read them when they run, after the
        # step loop below has rebound n.
        prefill_input = _one_input(prefill_inputs)
        tokens, chunk = args.prefill_context, args.prefill_chunk

        def put_prefill(name):
            def put(rows, got):
                row = rows.setdefault("prefill", {"tokens": tokens, "chunk": chunk, "fills": {}, "last_chunk_ms": {}})
                _put_prefill(row, name, got)
            return put

        for spec in _prefill_order(args.specs):
            cases.append(Case(f"prefill {tokens} {spec.name}",
                              lambda spec=spec: probe_prefill_spec(spec, *prefill_input(tokens), chunk, args.fills),
                              put_prefill(spec.name)))
    if "step" in args.parts:
        step_input = _one_input(step_inputs)
        for n in args.contexts:
            for spec in args.specs:
                cases.append(Case(f"step {n} {spec.name}", lambda n=n, spec=spec: probe_step_spec(spec, *step_input(n)),
                                  setter("step", str(n))))
    return cases


def run_cases(cases: list[Case], result: dict, *, budget_s: float | None, save, log) -> dict:
    """Run `cases` in order into result["results"], recording each in result["cases"] (done /
    error / skipped, seconds) and calling save() after each, so a device time-out keeps every
    finished case. No case starts once `budget_s` seconds are spent (it is recorded as
    skipped); a failing case records its error and the next one runs."""
    from veloxquant_mlx.bench.speed import _error_text

    rows = result.setdefault("results", {})
    done = result.setdefault("cases", [])
    t0 = time.perf_counter()
    for case in cases:
        elapsed = time.perf_counter() - t0
        if budget_s is not None and elapsed > budget_s:
            done.append({"case": case.name, "status": "skipped",
                         "reason": f"budget: {elapsed:.0f} s spent of --budget-s {budget_s:g}"})
            log(f"{case.name}: skipped (budget)")
            continue
        start = time.perf_counter()
        try:
            value = case.measure()
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            entry = {"case": case.name, "status": "error", "error": _error_text(exc)}
        else:
            case.put(rows, value)
            entry = {"case": case.name, "status": "done"}
        entry["seconds"] = time.perf_counter() - start
        done.append(entry)
        log(f"{case.name}: {entry['status']} in {entry['seconds']:.1f} s" +
            (f" ({entry['error'][:200]})" if "error" in entry else ""))
        result["elapsed_s"] = time.perf_counter() - t0
        save()
    result["elapsed_s"] = time.perf_counter() - t0
    save()
    return result


def on_cuda() -> bool:
    from veloxquant_mlx.cache.fused_decode import _on_cuda

    return _on_cuda()


def require_cuda(module: str) -> None:
    """Refuse to run `module` (a probe timing CUDA kernels) where MLX's CUDA backend is not the
    default device: a usage error naming the module, not figures of the portable path."""
    from veloxquant_mlx.errors import QuantizerConfigError

    if not on_cuda():
        raise QuantizerConfigError(f"{module} needs MLX's CUDA backend as the default device (it times CUDA kernels)")


def _log(message: str) -> None:
    print(f"[kernel_probe {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args, header: dict | None = None) -> dict:
    """Every case of args (build_cases), the result written to args.out after each."""
    from veloxquant_mlx.bench import constants, report

    require_cuda(MODULE)
    settings = constants.apply_settings(args.set)
    result = {**(header or {}),
              "settings": {"parts": args.parts, "contexts": args.contexts,
                           "methods": [s.name for s in args.specs], "constants_set": settings,
                           "prefill_context": args.prefill_context, "prefill_chunk": args.prefill_chunk,
                           "fills": args.fills, "budget_s": args.budget_s},
              "results": {}, "cases": []}

    def save():
        if args.out:
            report.write_json(result, args.out)

    return run_cases(build_cases(args), result, budget_s=args.budget_s, save=save, log=_log)


def main(argv=None) -> int:
    from veloxquant_mlx.bench import command
    from veloxquant_mlx.errors import QuantizerConfigError

    args = parse_args(argv)
    header = command.start(args)
    try:
        result = run(args, header)
    except QuantizerConfigError as exc:
        return command.usage_error(MODULE, str(exc))
    return command.finish(result, args.out)


if __name__ == "__main__":
    sys.exit(main())
