"""minicache's decode attention per kind of layer against fp16's, one layer of the 8B shape, on CUDA.

    python -m veloxquant_mlx.bench.pair_probe --contexts 32768,131072 --out X.json   # MLX's CUDA backend only

Why: in session 44's interleaved 32K run on an H100 (results/gpu_speed_h100_s44_32k.json)
minicache's 8-layer step took 2.38-2.43 ms whether fp16's step waited on its host or on the
GPU, with 1.6 ms of host: its step waits on the GPU, 0.2-0.25 ms longer than fp16's fast
rounds. Half its layers are plain (mx.fast attention over its window, as fp16's), half paired
(fused_decode_merged's kernel over the pair's shared direction, as many bytes as fp16's K/V).
This times each kind alone, beside fp16's own attention, so the step's excess can be put on one.

Cases per context n (ms per call: kernel_probe.per_call_ms, the calls' graphs built before the
clock, chained on one cache, median of 5 batches), one query row per head of 32 over 8 KV heads,
head_dim 128, bf16, n random history tokens plus one decode token:
  - `fp16_contiguous`: mx.fast.scaled_dot_product_attention over contiguous K/V;
  - `fp16_kvcache`: the same over the views mlx-lm's KVCache returns after a 2048-token-chunk
    prefill and the decode token's update_and_fetch (its buffer grown by 256 past the history,
    so the views skip its unused rows): what fp16's model step attends;
  - `minicache_plain`: a plain minicache layer's `attention` (its window, mx.fast);
  - `minicache_lower` / `minicache_upper`: the two layers of a pair (`minicache_start_fraction`
    0.0), each holding its own history merged by the pair, the decode token in its window;
  - `kivi`: kivi-2's `attention` (the affine kernel), a compressed reference.
`--variants` times the pair's layers again under other settings of fused_decode_merged's kernel
(VARIANTS; the kernel rebuilt, each layer's launch plan dropped, the shipped settings restored):
`noprefetch` (PREFETCH_FIRST_VALUES off: 170 registers instead of 222 by nvcc's count, 3 blocks
of 4 warps per SM instead of 2), `tw512` / `tw2048` / `tw4096` / `tw8192` (TARGET_WARPS; 1024
shipped since session 44, 4096 before), `lb3` / `lb4` (`__launch_bounds__(128, 3 / 4)`: ptxas
keeps the registers to 170 / 128 per thread, spilling where it cannot).
"""

from __future__ import annotations

import sys

MODULE = "veloxquant_mlx.bench.pair_probe"
HQ, HK, D = 32, 8, 128
CHUNK = 2048
CASES = ("fp16_contiguous", "fp16_kvcache", "minicache_plain", "minicache_lower", "minicache_upper", "kivi")
# name -> (fused_decode_merged constants, launch bounds' blocks per SM or 0)
VARIANTS = {
    "noprefetch": ({"PREFETCH_FIRST_VALUES": False}, 0),
    "tw512": ({"TARGET_WARPS": 512}, 0),
    "tw4096": ({"TARGET_WARPS": 4096}, 0),
    "tw2048": ({"TARGET_WARPS": 2048}, 0),
    "tw8192": ({"TARGET_WARPS": 8192}, 0),
    "lb3": ({}, 3),
    "lb4": ({}, 4),
}
PAIR_CASES = ("minicache_lower", "minicache_upper")


def layer_tensors(n: int, seed: int):
    """(k, v) of n + 1 tokens (the last one the decode token) of one layer, evaluated."""
    import mlx.core as mx

    key = mx.random.key(seed)
    k, v = (mx.random.normal((1, HK, n + 1, D), key=sub).astype(mx.bfloat16) for sub in mx.random.split(key))
    mx.eval(k, v)
    return k, v


def kvcache_views(k, v):
    """The views an mlx-lm KVCache returns at the decode token after a CHUNK-token prefill."""
    from mlx_lm.models.cache import KVCache

    cache, n = KVCache(), k.shape[2] - 1
    for s0 in range(0, n, CHUNK):
        cache.update_and_fetch(k[:, :, s0 : min(n, s0 + CHUNK)], v[:, :, s0 : min(n, s0 + CHUNK)])
    return cache.update_and_fetch(k[:, :, n:], v[:, :, n:])


def filled(caches, tensors, q) -> None:
    """Each cache holds its layer's history (merged into the store by a first attention call,
    lower layer first as in a model) and then its decode token, one decode attention evaluated."""
    import mlx.core as mx

    for cache, (k, v) in zip(caches, tensors):
        n = k.shape[2] - 1
        cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
        mx.eval(cache.attention(q, scale=D**-0.5))
    for cache, (k, v) in zip(caches, tensors):
        cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
        mx.eval(cache.attention(q, scale=D**-0.5))


def cases(n: int) -> dict:
    """name -> a function building one call's attention output (1, HQ, 1, D), every cache filled."""
    import mlx.core as mx

    from veloxquant_mlx.cache.factory import KVCacheFactory
    from veloxquant_mlx.cache.minicache import MiniCacheCache
    from veloxquant_mlx.config import KVCacheConfig

    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(7)).astype(mx.bfloat16)
    low, up = layer_tensors(n, 1), layer_tensors(n, 2)
    scale = D**-0.5
    keys, values = kvcache_views(*low)
    pair = MiniCacheCache.build_layers(KVCacheConfig(method="minicache", minicache_start_fraction=0.0), 2)
    plain = MiniCacheCache.build_layers(KVCacheConfig(method="minicache", minicache_start_fraction=1.0), 1)
    kivi = KVCacheFactory.create(KVCacheConfig(method="kivi"))
    filled(pair, (low, up), q)
    filled(plain, (low,), q)
    filled([kivi], (low,), q)
    if not pair[0].n_compressed or pair[0].n_compressed != pair[1].n_compressed:
        raise RuntimeError(f"{MODULE}: the pair did not merge its history ({pair[0].n_compressed} / "
                           f"{pair[1].n_compressed} tokens compressed of {n})")
    return Cases(pair, {
        "fp16_contiguous": lambda: mx.fast.scaled_dot_product_attention(q, *low, scale=scale),
        "fp16_kvcache": lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale),
        "minicache_plain": lambda: plain[0].attention(q, scale=scale),
        "minicache_lower": lambda: pair[0].attention(q, scale=scale),
        "minicache_upper": lambda: pair[1].attention(q, scale=scale),
        "kivi": lambda: kivi.attention(q, scale=scale),
    })


class Cases(dict):
    """cases()' name -> function map, with the pair's caches (`caches`) a variant re-plans."""

    def __init__(self, caches, functions):
        super().__init__(functions)
        self.caches = caches


def merged_variant(name: str, caches):
    """fused_decode_merged built with VARIANTS[name]'s settings while inside (batch_probe's
    kernel_variant: restored on exit, `caches`' launch plans dropped on entry and exit)."""
    from veloxquant_mlx.bench.batch_probe import kernel_variant
    from veloxquant_mlx.cache import fused_decode, fused_decode_merged as module

    constants, min_blocks = VARIANTS[name]
    if min_blocks:
        constants = {**constants, "_HEADER": module._HEADER + fused_decode.launch_bounds_header(min_blocks)}
    return kernel_variant(module, "_PARTIALS", (), constants, caches)


def parse_args(argv=None):
    from veloxquant_mlx.bench import command

    p = command.parser(MODULE, __doc__)
    p.add_argument("--contexts", default="32768,131072", help="comma list of history lengths")
    p.add_argument("--variants", default="", help=f"comma list of the pair's kernel variants to time besides "
                                                     f"the shipped one: {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    args.variants = command.name_list(p, "--variants", args.variants, tuple(VARIANTS)) if args.variants else []
    args.contexts = command.int_list(p, "--contexts", args.contexts, lambda x: x >= CHUNK,
                                     f"a comma list of integers >= {CHUNK}", required=True)
    return args


def run(args) -> dict:
    from veloxquant_mlx.bench.kernel_probe import per_call_ms, require_cuda

    require_cuda(MODULE)
    rows = {}
    for n in args.contexts:
        built = cases(n)
        rows[str(n)] = {f"{name}_ms": per_call_ms(fn, build_untimed=True) for name, fn in built.items()}
        for variant in args.variants:
            with merged_variant(variant, built.caches):
                for name in PAIR_CASES:
                    rows[str(n)][f"{name}_{variant}_ms"] = per_call_ms(built[name], build_untimed=True)
        print(f"[pair_probe] {n}: " + ", ".join(f"{k} {v:.4f}" for k, v in rows[str(n)].items()),
              file=sys.stderr, flush=True)
        del built
    return {"settings": {"contexts": args.contexts, "variants": args.variants}, "results": rows}


def main(argv=None) -> int:
    from veloxquant_mlx.bench import command

    return command.run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
