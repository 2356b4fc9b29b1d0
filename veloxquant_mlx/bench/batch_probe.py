"""Where kvquant's, GEAR's and turboquant_rvq's decode kernels spend their time: variants timed in one process.

    python -m veloxquant_mlx.bench.batch_probe --contexts 131072,32768 \
        --methods kvquant,gear,turboquant_rvq --out X.json          # MLX's CUDA backend only

One layer of the 8B shape (32 query / 8 KV heads, head_dim 128, bf16) per method: a cache of the
method's defaults holding `n` random tokens plus one decode token, then its whole
`cache.attention` of one query row per head, ms per call (calls chained on the cache's launch
state, as a model's steps run; graphs built before the clock; median of 5 batches: kernel_probe's
per_call_ms), once per variant of its kernel:
  - kvquant (fused_decode_codebook): `shipped`; the loads' batches at other settings (`ob1`:
    OUTLIER_BATCH 1, `ob4` (session 11's; 8 shipped since session 12; session 12's runs named
    the then-unshipped 8 `ob8`), `ob1ub1`: outliers and the unaligned value loop one at a time,
    the kernel before session 11); `novalue`: the unaligned (3-bit) value loop never runs;
    `nooutliers`: neither outlier loop runs; `bare`: neither (codebook keys and the aligned
    value path only); `keyunroll4` / `keyunroll13`: the unaligned (3-bit) key loop's runs
    unrolled 4 / 13 at a time instead of 2 (more loads in flight, more registers); `ksl`:
    KEY_SLOTS_BY_ROW (the key outliers' atomics on row-major slots, session 29);
  - gear (fused_decode_gear): `shipped`, `ob1`, `ob8`; `nooutliers`: neither sparse loop runs;
    `norank`: both low-rank terms skipped; `pf`: fused_decode.L2_PREFETCH (session 30); `keyplain` / `valueplain`: the key / value sparse
    terms' shared-memory atomics (for the keys: the scan's steps whose lanes meet on one token,
    since session 29's PLAIN_KEY_ADDS) as plain adds (racy: their cost, not a kernel);
  - turboquant_rvq (fused_decode_rotated): `shipped`; `noscore`: the history's key chunks never
    scored; `novalue`: its history value loop never runs (both first timed in session 12);
    `sums64`: MAX_VALUE_SUMS 64 (16 value channels per lane at 4 rows instead of 8);
    `keyunroll` / `keyunroll2`: the key chunks' loop unrolled whole / 2 at a time instead of
    rolled (their loads in flight together); `valunroll`: the value batches' loop unrolled;
    `keyunroll_sums64`: both; `lb0`: without the launch bounds shipped since session 12
    (MIN_BLOCKS_PER_SM 0);
  - kivi (fused_decode, the affine kernel xquant shares): `shipped` (both products on tensor
    cores since session 30); `fma`: both by the FMA loops, as shipped before; on top of those,
    `mma`: MMA_SCORES alone (the history's scores on tensor cores, session 22); `mmav`:
    MMA_VALUES alone (its values on tensor cores); `mmav_mma`: both; `pf`: L2_PREFETCH (the next
    tile's keys and this tile's values asked into L2 first); `noscore`: the history's key loop
    never runs; `novalue`: its value loop never runs; `nokeycompute`: the keys staged, never
    scored; `nokeystage`: the scores computed from a stage never filled (session 30: where
    kivi's time goes at 128K; the cuts name the FMA loops);
  - any other method: `shipped` only (a reference beside them);
  - every method, its fused launch (fused_decode's prologue, epilogue and merge, which every
    partials kernel shares; LAUNCH_VARIANTS, session 32): `nomerge`, no block merges (every
    block writes its partial, the output is left unwritten: the merge's cost by difference);
    `empty`, every thread returns at once (the chained call's floor: its launch and MLX's work
    per call); `onelevel`, the merge in one level at any block count (the merge before session
    32); `group8` / `group32`, the merge's first level in groups of 8 / 32 blocks instead of 16
    (kernel_header.MERGE_GROUP and every kernel header's VQ_MERGE_GROUP set together, so that
    the counters and the scratch are sized for the kernel's groups).
A variant that cuts work computes a wrong attention: it says what the cut part costs, nothing
else. The cuts are exact source spans (VARIANTS): a change to a kernel that moves one fails here
before anything is timed. Why one process: two packages on one machine would need `python -m` run
from each package's own directory (from the checkout it imports the checkout first), and two
machines differ more than these variants do.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time

MODULE = "veloxquant_mlx.bench.batch_probe"
HQ, HK, D = 32, 8, 128

# Loops whose unrolling a variant changes (the pragma and the loop line, exact text).
_KVQ_KEY_RUNS = "#pragma unroll {}\n        for (int g = 0; g < RUNS; ++g) {{"
_RVQ_KEY_CHUNKS = "#pragma unroll{}\n      for (int chunk = 0; chunk < D / 32; ++chunk) {{"
_RVQ_VALUE_BATCHES = "#pragma unroll{}\n      for (int b0 = 0; b0 < ROUNDS; b0 += BATCH) {{"

# method -> (kernel module, attribute holding the source, {variant: (cuts, constants)}); a cut is
# (text, replacement), applied once each in order.
VARIANTS = {
    "kvquant": ("veloxquant_mlx.cache.fused_decode_codebook", "_PARTIALS", {
        "shipped": ((), {}),
        "ob1": ((), {"OUTLIER_BATCH": 1}),
        "ob4": ((), {"OUTLIER_BATCH": 4}),
        "ob1ub1": ((), {"OUTLIER_BATCH": 1, "UNALIGNED_VALUE_BATCH": 1}),
        "novalue": ((("for (int b0 = 0; b0 < ROUNDS; b0 += UBATCH) {", "for (int b0 = 0; b0 < 0; b0 += UBATCH) {"),), {}),
        "nooutliers": ((("for (int j0 = lane; j0 < n_entries; j0 += 32 * OB) {", "for (int j0 = lane; j0 < 0; j0 += 32 * OB) {"),) * 2, {}),
        "bare": ((("for (int b0 = 0; b0 < ROUNDS; b0 += UBATCH) {", "for (int b0 = 0; b0 < 0; b0 += UBATCH) {"),
                  *(("for (int j0 = lane; j0 < n_entries; j0 += 32 * OB) {", "for (int j0 = lane; j0 < 0; j0 += 32 * OB) {"),) * 2), {}),
        "keyunroll4": (((_KVQ_KEY_RUNS.format(2), _KVQ_KEY_RUNS.format(4)),), {}),
        "keyunroll13": (((_KVQ_KEY_RUNS.format(2), _KVQ_KEY_RUNS.format(13)),), {}),
        "ksl": ((), {"KEY_SLOTS_BY_ROW": True}),
    }),
    "gear": ("veloxquant_mlx.cache.fused_decode_gear", "PARTIALS_SOURCE", {
        "shipped": ((), {}),
        "ob1": ((), {"OUTLIER_BATCH": 1}),
        "ob8": ((), {"OUTLIER_BATCH": 8}),
        "nooutliers": ((("vq_gear_tile_entries<KCNT,", "vq_gear_tile_entries<0,"),
                        ("vq_gear_tile_entries<VCNT,", "vq_gear_tile_entries<0,")), {}),
        "norank": ((("if (RANK > 0) {", "if (false) {"),) * 2, {}),
        # session 30: fused_decode.L2_PREFETCH in GEAR's build of the affine source
        "pf": ((), {"fused_decode.L2_PREFETCH": 1}),
        # session 29: the sparse terms' shared-memory atomics as plain adds (racy where two
        # entries of a round meet on one slot: what the atomics cost, not a correct kernel)
        "keyplain": ((("else atomicAdd(sum, qs[c * R + r] * val);", "else *sum += qs[c * R + r] * val;"),), {}),
        "valueplain": ((("atomicAdd(&vsp_w[r * DV + c], p_tile[tile_slot(t) * R + r] * val);",
                         "vsp_w[r * DV + c] += p_tile[tile_slot(t) * R + r] * val;"),), {}),
    }),
    "turboquant_rvq": ("veloxquant_mlx.cache.fused_decode_rotated", "_PARTIALS", {
        "shipped": ((), {}),
        "noscore": ((("for (int chunk = 0; chunk < D / 32; ++chunk) {", "for (int chunk = 0; chunk < 0; ++chunk) {"),), {}),
        "novalue": ((("for (int b0 = 0; b0 < ROUNDS; b0 += BATCH) {", "for (int b0 = 0; b0 < 0; b0 += BATCH) {"),), {}),
        "sums64": ((), {"MAX_VALUE_SUMS": 64}),
        "keyunroll": (((_RVQ_KEY_CHUNKS.format(" 1"), _RVQ_KEY_CHUNKS.format("")),), {}),
        "keyunroll2": (((_RVQ_KEY_CHUNKS.format(" 1"), _RVQ_KEY_CHUNKS.format(" 2")),), {}),
        "valunroll": (((_RVQ_VALUE_BATCHES.format(" 1"), _RVQ_VALUE_BATCHES.format("")),), {}),
        "keyunroll_sums64": (((_RVQ_KEY_CHUNKS.format(" 1"), _RVQ_KEY_CHUNKS.format("")),), {"MAX_VALUE_SUMS": 64}),
        "lb0": ((), {"MIN_BLOCKS_PER_SM": 0}),
    }),
}
# The switches of kivi's two products, pinned per variant: the FMA loops (as shipped until
# session 30, when the variants below were first timed, and what the cuts name) or tensor cores.
_FMA = {"MMA_SCORES": 0, "MMA_VALUES": 0}
VARIANTS["kivi"] = ("veloxquant_mlx.cache.fused_decode", "_PARTIALS", {
    "shipped": ((), {}),
    "fma": ((), _FMA),
    "mma": ((), {**_FMA, "MMA_SCORES": 1}),
    "mmav": ((), {**_FMA, "MMA_VALUES": 1}),
    "mmav_mma": ((), {"MMA_VALUES": 1, "MMA_SCORES": 1}),
    "pf": ((), {**_FMA, "L2_PREFETCH": 1}),
    "noscore": ((("for (int c0 = 0; c0 < D; c0 += KSC) {", "for (int c0 = 0; c0 < 0; c0 += KSC) {"),), _FMA),
    "novalue": ((("for (int v0 = 0; v0 < TILE; v0 += VST) {", "for (int v0 = 0; v0 < 0; v0 += VST) {"),), _FMA),
    "nokeycompute": ((("for (int dd = 0; dd < KSC; ++dd) {", "for (int dd = 0; dd < 0; ++dd) {"),), _FMA),
    "nokeystage": ((("        stage_keys(base, c0);\n", "\n"),), _FMA),
    # The same cuts of the tensor-core loops (both switches on, as shipped since session 30).
    "noscore_tc": ((("for (int gi = 0; gi < NGK; ++gi) {", "for (int gi = 0; gi < 0; ++gi) {"),), {}),
    "novalue_tc": ((("for (int v0 = 0; v0 < TILE; v0 += VST) {", "for (int v0 = 0; v0 < 0; v0 += VST) {"),), {}),
})
# Variants of every method's fused launch (see the docstring): the fused prologue / epilogue and
# the kernel headers' merge group, patched in fused_decode and in each kernel module's header.
LAUNCH_VARIANTS = ("nomerge", "empty", "onelevel", "group8", "group32")
# The merge group each launch variant builds with (None: the shipped MERGE_GROUP).
_VARIANT_GROUPS = {"onelevel": 1 << 30, "group8": 8, "group32": 32}
# Kernel modules whose `_HEADER` begins with fused_decode's (the merge's VQ_MERGE_GROUP).
HEADER_MODULES = ("fused_decode", "fused_decode_codebook", "fused_decode_gear", "fused_decode_rotated",
                  "fused_decode_merged")
_MERGE_CALL = re.compile(r"  vq_merge_if_last<R, DV>\([^;]*\);\n")
_EMPTY = "  if (threadIdx.x < 100000) return;  // batch_probe `empty`: every thread returns\n"


def launch_variant_sources(name: str, prologue: str, epilogue: str, headers: dict) -> tuple:
    """(prologue, epilogue, {module: header}) of launch variant `name` from the shipped ones (its
    merge group, where it has one of its own, is _VARIANT_GROUPS'); a part the variant needs
    and no longer finds raises (as variant_source's cuts do)."""
    from veloxquant_mlx.cache import kernel_header
    from veloxquant_mlx.errors import QuantizerConfigError

    no_merge = _MERGE_CALL.sub("", epilogue)
    group = f"constexpr int VQ_MERGE_GROUP = {kernel_header.MERGE_GROUP};"
    if no_merge == epilogue or any(group not in h for h in headers.values()):
        raise QuantizerConfigError(f"{MODULE}: the fused epilogue or a kernel header no longer holds the merge "
                                   "a launch variant patches: update LAUNCH_VARIANTS")
    if name == "nomerge":
        return prologue, no_merge, headers
    if name == "empty":
        return prologue + _EMPTY, no_merge, headers
    if name in _VARIANT_GROUPS:
        own = f"constexpr int VQ_MERGE_GROUP = {_VARIANT_GROUPS[name]};"
        return prologue, epilogue, {m: h.replace(group, own) for m, h in headers.items()}
    raise QuantizerConfigError(f"{MODULE}: launch variant {name!r}; allowed: {', '.join(LAUNCH_VARIANTS)}")


@contextlib.contextmanager
def launch_variant(name: str):
    """Within: every kernel built with launch variant `name` (the kernel factories emptied on the
    way in and out, so that nothing built before or within outlives it)."""
    import importlib

    from veloxquant_mlx.bench.step_census import kernel_factories
    from veloxquant_mlx.cache import kernel_header, partials_merge_source

    modules = [importlib.import_module(f"veloxquant_mlx.cache.{m}") for m in HEADER_MODULES]
    shipped = (partials_merge_source.FUSED_PROLOGUE, partials_merge_source.FUSED_EPILOGUE,
               {m: m._HEADER for m in modules})
    prologue, epilogue, headers = launch_variant_sources(name, *shipped)
    group = kernel_header.MERGE_GROUP
    factories = kernel_factories()
    try:
        # the launch's counters and scratch are sized by MERGE_GROUP: the kernel's groups
        kernel_header.MERGE_GROUP = _VARIANT_GROUPS.get(name, group)
        partials_merge_source.FUSED_PROLOGUE, partials_merge_source.FUSED_EPILOGUE = prologue, epilogue
        for m, header in headers.items():
            m._HEADER = header
        for f in factories:
            f.cache_clear()
        yield
    finally:
        kernel_header.MERGE_GROUP = group
        partials_merge_source.FUSED_PROLOGUE, partials_merge_source.FUSED_EPILOGUE = shipped[:2]
        for m, header in shipped[2].items():
            m._HEADER = header
        for f in factories:
            f.cache_clear()


# The lru_cache holding a module's built kernels (cleared so that a variant's source is built).
KERNEL_CACHES = {"veloxquant_mlx.cache.fused_decode": "_kernels"}
SHIPPED_ONLY = {"shipped": ((), {})}
METHODS = ("kvquant", "gear", "turboquant_rvq", "kivi", "xquant")


def variant_source(source: str, cuts) -> str:
    """`source` with each cut applied once, in order; a cut whose text is missing raises."""
    from veloxquant_mlx.errors import QuantizerConfigError

    for old, new in cuts:
        if old not in source:
            raise QuantizerConfigError(f"{MODULE}: the kernel source no longer holds {old!r}: update VARIANTS")
        source = source.replace(old, new, 1)
    return source


def check_variants() -> None:
    """Every variant's cuts apply to today's sources and its constants exist (before any timing)."""
    import importlib

    from veloxquant_mlx.errors import QuantizerConfigError

    for method, (module_name, attribute, variants) in VARIANTS.items():
        module = importlib.import_module(module_name)
        for name, (cuts, constants) in variants.items():
            variant_source(getattr(module, attribute), cuts)
            missing = [c for c in constants if not hasattr(*constant_home(module, c))]
            if missing:
                raise QuantizerConfigError(f"{MODULE}: {method} variant {name}: {module_name} has no {missing}")
    for name in LAUNCH_VARIANTS:
        with launch_variant(name):
            pass


def kernel_cache(module):
    """The lru_cache of `module`'s built partials kernel (KERNEL_CACHES, else `_partials_kernel`)."""
    return getattr(module, KERNEL_CACHES.get(module.__name__, "_partials_kernel"))


def constant_home(module, name: str):
    """(module, attribute) a variant's constant names: `name` in `module`, or `other.NAME` in
    veloxquant_mlx.cache.other (a constant of the source a kernel is built on)."""
    import importlib

    if "." in name:
        other, attribute = name.rsplit(".", 1)
        return importlib.import_module(f"veloxquant_mlx.cache.{other}"), attribute
    return module, name


@contextlib.contextmanager
def kernel_variant(module, attribute: str, cuts, constants: dict, caches):
    """`module`'s kernel built with `attribute`'s text cut by `cuts` and `constants` set (see
    constant_home) while inside, both restored on exit; the built kernel's cache cleared and
    `caches`' launch plans dropped on entry and exit, so their next steps plan with the kernel in
    force."""
    shipped = getattr(module, attribute)
    saved = {c: getattr(*constant_home(module, c)) for c in constants}

    def reset():
        kernel_cache(module).cache_clear()
        for cache in caches:
            cache.__dict__.pop("_fused_plan", None)

    try:
        setattr(module, attribute, variant_source(shipped, cuts))
        for c, value in constants.items():
            setattr(*constant_home(module, c), value)
        reset()
        yield
    finally:
        setattr(module, attribute, shipped)
        for c, value in saved.items():
            setattr(*constant_home(module, c), value)
        reset()


def time_variant(module, attribute: str, cache, queries, cuts, constants) -> float:
    """ms per attention call with the variant's source and constants in place (restored after)."""
    from veloxquant_mlx.bench.kernel_probe import per_call_ms

    with kernel_variant(module, attribute, cuts, constants, [cache]):
        return per_call_ms(lambda: cache.attention(queries, scale=D**-0.5), build_untimed=True)


def layer_inputs(n: int):
    """(k, v, q, new) of one layer of the 8B shape in bf16, evaluated: n history tokens' keys
    and values, a query row per head, one decode token (random, seed 2)."""
    import mlx.core as mx

    mx.random.seed(2)
    k, v = (mx.random.normal((1, HK, n, D)).astype(mx.bfloat16) for _ in range(2))
    q = mx.random.normal((1, HQ, 1, D)).astype(mx.bfloat16)
    new = mx.random.normal((1, HK, 1, D)).astype(mx.bfloat16)
    mx.eval(k, v, q, new)
    return k, v, q, new


def filled_cache(method: str, inputs):
    """A cache of `method`'s defaults holding layer_inputs' history (flushed into its store by a
    first attention call) plus its decode token, one decode attention evaluated."""
    import mlx.core as mx

    from veloxquant_mlx.cache.factory import KVCacheFactory
    from veloxquant_mlx.config import KVCacheConfig

    k, v, q, new = inputs
    cache = KVCacheFactory.create(KVCacheConfig(method=method))
    cache.update_and_fetch(k, v)
    mx.eval(cache.attention(q, scale=D**-0.5))  # the prompt flushed into the store
    cache.update_and_fetch(new, new)
    mx.eval(cache.attention(q, scale=D**-0.5))
    return cache


def probe_context(n: int, methods, log, only=None) -> dict:
    """fp16 `mx.fast` attention and every method's variants at context n (those named in `only`
    where given; `shipped` always)."""
    import importlib

    import mlx.core as mx

    from veloxquant_mlx.bench.kernel_probe import per_call_ms

    inputs = layer_inputs(n)
    k, v, q, _ = inputs
    row = {"fp16_sdpa_ms": per_call_ms(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5),
                                       build_untimed=True)}
    for method in methods:
        start = time.perf_counter()
        cache = filled_cache(method, inputs)
        log(f"{method} at {n}: filled in {time.perf_counter() - start:.1f} s")
        module_name, attribute, variants = VARIANTS.get(method, (None, None, SHIPPED_ONLY))
        module = importlib.import_module(module_name) if module_name else None
        for name, (cuts, constants) in variants.items():
            if only is not None and name != "shipped" and name not in only:
                continue
            if module is None:
                ms = per_call_ms(lambda: cache.attention(q, scale=D**-0.5), build_untimed=True)
            else:
                ms = time_variant(module, attribute, cache, q, cuts, constants)
            row[f"{method}_{name}_ms"] = ms
            log(f"  {method} {name}: {ms:.4f} ms")
        for name in LAUNCH_VARIANTS:
            if only is not None and name not in only:
                continue
            with launch_variant(name):
                cache.__dict__.pop("_fused_plan", None)  # the next step plans with the variant's kernels
                ms = per_call_ms(lambda: cache.attention(q, scale=D**-0.5), build_untimed=True)
            cache.__dict__.pop("_fused_plan", None)
            row[f"{method}_{name}_ms"] = ms
            log(f"  {method} {name}: {ms:.4f} ms")
        del cache
    return row


def parse_args(argv=None):
    from veloxquant_mlx.bench import command

    p = command.parser(MODULE, __doc__)
    p.add_argument("--contexts", default="131072,32768", help="comma list of history lengths")
    p.add_argument("--methods", default="kvquant,gear,turboquant_rvq",
                   help="comma list of cache methods (kvquant, gear, turboquant_rvq and kivi have variants)")
    p.add_argument("--variants", default=None,
                   help="comma list of variant names to time besides `shipped` (default: all of each method's)")
    args = p.parse_args(argv)
    if args.variants is not None:
        known = sorted({name for _, _, variants in VARIANTS.values() for name in variants} | set(LAUNCH_VARIANTS))
        args.variants = command.name_list(p, "--variants", args.variants, known, "")
    try:
        args.contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    except ValueError:
        p.error(f"--contexts {args.contexts!r}: allowed is a comma list of integers >= 1")
    if not args.contexts or min(args.contexts) < 1:
        p.error(f"--contexts {args.contexts!r}: allowed is a comma list of integers >= 1")
    args.methods = command.name_list(p, "--methods", args.methods, METHODS,
                                     " (a standalone minicache / pyramidkv cache attends as a plain layer: "
                                     "nothing to probe)")
    return args


def _log(message: str) -> None:
    print(f"[batch_probe {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args) -> dict:
    from veloxquant_mlx.bench.kernel_probe import require_cuda

    check_variants()
    require_cuda(MODULE)
    rows = {str(n): probe_context(n, args.methods, _log, args.variants) for n in args.contexts}
    return {"settings": {"contexts": args.contexts, "methods": args.methods, "variants": args.variants},
            "results": rows}


def main(argv=None) -> int:
    from veloxquant_mlx.bench import command

    return command.run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
