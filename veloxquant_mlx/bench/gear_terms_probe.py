"""What GEAR's terms cost its decode kernel, per split, in one process (MLX's CUDA backend only).

    python -m veloxquant_mlx.bench.gear_terms_probe --contexts 32768,131072 \
        --warps 1024,2048,4096 --out X.json

Why: on the H200 one layer's chained attention of GEAR took ~89 us at 32K against kivi's ~62
(results/lb_h200_s23_warps_32768.json), and where kivi gains ~20 us from fewer, longer warps
(1024 target warps, two 128-token tiles per warp) GEAR loses ~17 (107 us): GEAR's decode is
kivi's kernel plus, per tile, a low-rank term for keys and values and a scan of its 256-token
block's sparse outliers (cache/fused_decode_gear.py). Which of them costs what, and whether they
cost more when a warp walks its tiles one after another, decides what to change.

What it runs: one layer of the 8B shape (32 query / 8 KV heads, head_dim 128, bf16), a GEAR cache
of the defaults holding `C` random tokens plus one decode token (bench.batch_probe), its whole
`cache.attention` timed chained as launch_bounds_probe times it (ms per call, graphs built before
the clock, median of 5 batches), for each target of `--warps` (the cache's decode_target_warps)
and each variant: the kernel as shipped, and the same launch with template constants changed
(VARIANTS): a term dropped (RANK / KCNT / VCNT = 0: the kernel then skips that term's code;
the arrays, split and shared-memory stages stay as shipped, so only the term's own work goes),
all three dropped (kivi's work over GEAR's store), or OB, the outlier entries a lane loads at
once. A dropped term changes the output (its max |diff| to shipped, recorded, shows that the
term was really off); OB must not (0 expected).

Registers (nvcc 13, sm_90, the 8B shape in bf16; `pytest -q -s -m slow
tests/cache/test_kernels_nvcc.py -k gear_terms`): shipped 96; one term dropped 96 / 96 / 106
(rank / key / value outliers); two dropped 123-130; all three 128. Not the cause of the terms'
cost: the shipped source bounded to 4 blocks per SM (`__launch_bounds__(128, 4)`: up to 128
registers) was no faster (session 22's lb4: 94.2 against 92.8 us at 32K, 271.6 against 270.5
at 128K; results/lb_h200_s22_*_default.json).

Measured (results/gear_terms_h200_s23.json, gear_terms_h200_s24.json; results/README.md): the
terms' costs do not add. At 32K and 4096 warps, us per layer: shipped 92.7, without the low rank
84.7, the key outliers 88.7, the value outliers 87.3, both outliers 82.2, low rank and key
outliers 71.8, low rank and value outliers 88.7, all three 66.2; at 128K the outliers are most of
it (264.6 shipped, 187.6 without both, 161.6 without all three). Loading a tile's outlier
entries into registers up front, ahead of the low rank's loads (session 24's PREFETCH_OUTLIERS,
128 registers against 96), was slower everywhere (session 25, results/gear_terms_h200_s25_pfo.json,
us per layer at 4096 warps: 4K 61.1 shipped / 64.9 / 58.9 with OB 1; 32K 91.4 / 114.2 / 111.1;
128K 265.0 / 291.6 / 289.8) and was removed.
"""

from __future__ import annotations

import contextlib
import sys
import time

MODULE = "veloxquant_mlx.bench.gear_terms_probe"

# name -> template constants changed in GEAR's decode launch (fused_decode_gear.store_arrays)
VARIANTS = {
    "shipped": {},
    "no_rank": {"RANK": 0},
    "no_key_outliers": {"KCNT": 0},
    "no_value_outliers": {"VCNT": 0},
    "no_terms": {"RANK": 0, "KCNT": 0, "VCNT": 0},
    # two of the three dropped: is the terms' cost the sum of their parts (session 23: 26 us at
    # 32K for all three, 2-5 us for each alone)?
    "no_outliers": {"KCNT": 0, "VCNT": 0},
    "no_rank_no_key_outliers": {"RANK": 0, "KCNT": 0},
    "no_rank_no_value_outliers": {"RANK": 0, "VCNT": 0},
    # session 29: every entry of the block read (as before), the key sums in p_tile's own layout
    "full_scan": {"OSORT": 0},
    "old_key_slots": {"KSL": 0},
    "full_scan_old_key_slots": {"OSORT": 0, "KSL": 0},
    # every step of the key scan adding by atomics (before PLAIN_KEY_ADDS)
    "key_atomics": {"KPLAIN": 0},
    "ob8": {"OB": 8},
    "ob12": {"OB": 12},
}


@contextlib.contextmanager
def template_changes(changes: dict):
    """GEAR's decode launches built with `changes` applied to their template constants while
    open (store_arrays wrapped; a cache's plan must be rebuilt to take it: drop_plan)."""
    from veloxquant_mlx.cache import fused_decode_gear

    original = fused_decode_gear.store_arrays

    def changed(cache):
        base, extra, template = original(cache)
        return base, extra, [(k, changes.get(k, v)) for k, v in template]

    fused_decode_gear.store_arrays = changed
    try:
        yield
    finally:
        fused_decode_gear.store_arrays = original


def drop_plan(cache) -> None:
    """Forget the cache's launch plan, so its next step builds one (fused_decode.planned_attend)."""
    cache.__dict__.pop("_fused_plan", None)


def probe_context(n: int, warps: list[int], variants: list[str], log) -> dict:
    """{f"tw{w}_{variant}_ms": ms per call, f"tw{w}_{variant}_max_abs_diff": ...} at context n."""
    import mlx.core as mx

    from veloxquant_mlx.bench.batch_probe import D, filled_cache, layer_inputs
    from veloxquant_mlx.bench.kernel_probe import per_call_ms

    inputs = layer_inputs(n)
    q = inputs[2]
    start = time.perf_counter()
    cache = filled_cache("gear", inputs)
    log(f"gear at {n}: filled in {time.perf_counter() - start:.1f} s")

    def call():
        return cache.attention(q, scale=D**-0.5)

    row = {}
    for w in warps:
        cache.decode_target_warps = w
        drop_plan(cache)
        reference = call()
        mx.eval(reference)
        for name in variants:
            with template_changes(VARIANTS[name]):
                drop_plan(cache)
                out = call()
                diff = mx.abs(out.astype(mx.float32) - reference.astype(mx.float32)).max().item()
                row[f"tw{w}_{name}_ms"] = per_call_ms(call, build_untimed=True)
            row[f"tw{w}_{name}_max_abs_diff"] = diff
            log(f"  {n} tokens, {w} warps, {name}: {row[f'tw{w}_{name}_ms']:.4f} ms, max |diff| {diff:.3g}")
        drop_plan(cache)
    cache.decode_target_warps = None
    return row


def parse_args(argv=None):
    from veloxquant_mlx.bench import command, constants

    p = command.parser(MODULE, __doc__)
    p.add_argument("--contexts", default="32768,131072", help="history tokens (default 32768,131072)")
    p.add_argument("--warps", default="1024,2048,4096", help="comma list of target warps (default 1024,2048,4096)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    constants.add_set_option(p)
    args = p.parse_args(argv)
    args.set = constants.parsed_settings(p, args.set)
    positives = "a comma list of positive integers"
    args.contexts = command.int_list(p, "--contexts", args.contexts, lambda n: n >= 1, positives, required=True)
    args.warps = command.int_list(p, "--warps", args.warps, lambda w: w >= 1, positives, required=True)
    args.variants = command.name_list(p, "--variants", args.variants, VARIANTS)
    return args


def _log(message: str) -> None:
    print(f"[gear_terms_probe {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args) -> dict:
    from veloxquant_mlx.bench import constants
    from veloxquant_mlx.bench.kernel_probe import require_cuda

    require_cuda(MODULE)
    settings = constants.apply_settings(args.set)
    rows = {str(n): probe_context(n, args.warps, args.variants, _log) for n in args.contexts}
    return {"settings": {"contexts": args.contexts, "warps": args.warps, "variants": args.variants,
                         "variant_templates": {v: VARIANTS[v] for v in args.variants}, "constants_set": settings},
            "results": rows}


def main(argv=None) -> int:
    from veloxquant_mlx.bench import command

    return command.run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
