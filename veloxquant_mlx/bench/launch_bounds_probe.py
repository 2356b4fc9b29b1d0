"""Decode kernels rebuilt with launch bounds, timed against themselves as shipped, in one process.

    python -m veloxquant_mlx.bench.launch_bounds_probe --context 131072 \
        --methods turboquant_rvq,kvquant,gear,kivi --bounds 5 --out X.json   # MLX's CUDA backend only
    python -m veloxquant_mlx.bench.launch_bounds_probe --methods kivi --bounds 4 \
        --set fused_decode.MMA_SCORES=1 --out Y.json   # a constant set first (bench/constants.py)
    python -m veloxquant_mlx.bench.launch_bounds_probe --context 32768 --bounds 0 \
        --methods kivi,xquant,gear,kvquant,turboquant_rvq --warps 1024,2048,4096 --out Z.json

Why: Nsight Compute on the H200 (results/ncu_h200_s12.json) found every decode kernel of ours at
4 blocks of 4 warps per SM, bound by registers (102-128 per thread), with ~1 eligible warp per
scheduler: more resident warps could hide more latency. mx.fast.cuda_kernel takes no register
limit; fused_decode.launch_bounds_header gives the kernel `__launch_bounds__(128, B)` from its
header, and ptxas then keeps the registers low enough for B blocks per SM (spilling where it
cannot).

What it runs, per method: one layer of the 8B shape (32 query / 8 KV heads, head_dim 128, bf16),
a cache of the method's defaults holding `--context` random tokens plus one decode token, its
whole `cache.attention` of one query row per head timed as bench.batch_probe times it (ms per
call, calls chained on the cache's launch state, graphs built before the clock, median of 5
batches): first as shipped, then for each B of `--bounds` with every decode partials kernel
rebuilt under a wrapper of mx.fast.cuda_kernel that appends the bounds to its header (B = 0:
the declaration reset to carry none, which undoes a shipped kernel's own bounds, e.g.
turboquant_rvq's at the 8B shape), its output compared with the shipped kernel's (max |diff|:
bounds change the register allocation, not the arithmetic, so 0 is expected). Written from the
ad-hoc probe of session 12 (results/lb_probe_h200_s12.json) after that run.

`--warps`: the same call with the cache's launches split for each W target warps (the cache's
`decode_target_warps`, which every decode kernel's split takes over its own target; the plan
is rebuilt), as shipped otherwise: the split sweep of session 22 (results/lb_h200_s22*_tw*.json,
there one process per target through --set) in one process, for every method's kernel. The
split changes which blocks sum which tokens, so the outputs differ in the last bits.
"""

from __future__ import annotations

import contextlib
import sys
import time

from veloxquant_mlx.bench.batch_probe import D, METHODS, filled_cache, layer_inputs

MODULE = "veloxquant_mlx.bench.launch_bounds_probe"
PROBED_KERNELS = "decode_partials"  # the partials kernels' names hold this; merges and encoders do not


def bounded_header(header: str, bounds: int) -> str:
    """`header` whose following kernel declaration carries __launch_bounds__(128, bounds); 0:
    none (a shipped kernel's own bounds undone: the last definition of the macro wins)."""
    from veloxquant_mlx.cache import fused_decode

    return header + (fused_decode.launch_bounds_header(bounds) if bounds
                     else fused_decode.kernel_declaration_header(""))


def _clear_factories() -> None:
    # Every decode kernel factory: a kernel object built before (or under) the wrapper must not
    # be reused after it.
    from veloxquant_mlx.cache import (fused_decode, fused_decode_codebook, fused_decode_gear,
                                      fused_decode_merged, fused_decode_rotated)

    for factory in (fused_decode._kernels, fused_decode_rotated._partials_kernel,
                    fused_decode_codebook._partials_kernel, fused_decode_gear._partials_kernel,
                    fused_decode_merged._partials_kernel):
        factory.cache_clear()


@contextlib.contextmanager
def bounded_kernels(bounds: int):
    """Within: each decode partials kernel built gets `bounds` (bounded_header) and a name of
    its own (MLX keys compiled modules by name and template only); factories emptied on entry
    and on exit, so kernels are rebuilt under and after the wrapper."""
    import mlx.core as mx

    original = mx.fast.cuda_kernel

    def factory(*, name, header="", **arguments):
        if PROBED_KERNELS in name:
            header, name = bounded_header(header, bounds), f"{name}_lb{bounds}"
        return original(name=name, header=header, **arguments)

    _clear_factories()
    mx.fast.cuda_kernel = factory
    try:
        yield
    finally:
        mx.fast.cuda_kernel = original
        _clear_factories()


def probe_method(method: str, n: int, bounds: list[int], log, warps: list[int] = ()) -> dict:
    """ms per call as shipped, under each bound and split for each target of `warps`, with the
    max |diff| of each to shipped."""
    import mlx.core as mx

    from veloxquant_mlx.bench.kernel_probe import per_call_ms

    inputs = layer_inputs(n)
    q = inputs[2]
    start = time.perf_counter()
    cache = filled_cache(method, inputs)

    def call():
        return cache.attention(q, scale=D**-0.5)

    shipped = call()
    mx.eval(shipped)
    row = {"shipped_ms": per_call_ms(call, build_untimed=True)}
    log(f"{method} at {n}: filled in {time.perf_counter() - start:.1f} s; shipped {row['shipped_ms']:.4f} ms")
    for b in bounds:
        with bounded_kernels(b):
            out = call()
            diff = mx.abs(out.astype(mx.float32) - shipped.astype(mx.float32)).max().item()
            row[f"lb{b}_ms"] = per_call_ms(call, build_untimed=True)
        row[f"lb{b}_max_abs_diff"] = diff
        log(f"  {method} bounds {b}: {row[f'lb{b}_ms']:.4f} ms, max |diff| {diff:.3g}")
    for w in warps:
        cache.decode_target_warps = w
        out = call()
        row[f"tw{w}_max_abs_diff"] = mx.abs(out.astype(mx.float32) - shipped.astype(mx.float32)).max().item()
        row[f"tw{w}_ms"] = per_call_ms(call, build_untimed=True)
        log(f"  {method} target warps {w}: {row[f'tw{w}_ms']:.4f} ms, max |diff| {row[f'tw{w}_max_abs_diff']:.3g}")
    cache.decode_target_warps = None
    return row


def parse_args(argv=None):
    from veloxquant_mlx.bench import command, constants
    from veloxquant_mlx.cache.fused_decode import MAX_MIN_BLOCKS

    p = command.parser(MODULE, __doc__)
    p.add_argument("--context", type=command.positive, default=131072, help="history tokens (default 131072)")
    p.add_argument("--methods", default="turboquant_rvq,kvquant,gear,kivi", help="comma list of cache methods")
    p.add_argument("--bounds", default="5", help=f"comma list of blocks per SM, 0..{MAX_MIN_BLOCKS} (0: no bounds)")
    p.add_argument("--warps", default="", help="comma list of target warps to split the launches for, "
                                                "per cache (default: none)")
    constants.add_set_option(p)
    args = p.parse_args(argv)
    args.set = constants.parsed_settings(p, args.set)
    args.methods = command.name_list(p, "--methods", args.methods, METHODS)
    args.bounds = command.int_list(p, "--bounds", args.bounds, lambda b: 0 <= b <= MAX_MIN_BLOCKS,
                                   f"a comma list of integers in 0..{MAX_MIN_BLOCKS}", required=True)
    args.warps = command.int_list(p, "--warps", args.warps, lambda w: w >= 1, "a comma list of positive integers",
                                  required=False)
    return args


def _log(message: str) -> None:
    print(f"[launch_bounds_probe {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args) -> dict:
    from veloxquant_mlx.bench import constants
    from veloxquant_mlx.bench.kernel_probe import require_cuda

    require_cuda(MODULE)
    # Constants set first: "shipped" is then the kernels built with them.
    settings = constants.apply_settings(args.set)
    rows = {m: probe_method(m, args.context, args.bounds, _log, args.warps) for m in args.methods}
    return {"settings": {"context": args.context, "methods": args.methods, "bounds": args.bounds,
                         "warps": args.warps,
                         "threads_per_block": 128, "constants_set": settings},
            "results": rows}


def main(argv=None) -> int:
    from veloxquant_mlx.bench import command

    return command.run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
