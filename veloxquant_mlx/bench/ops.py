"""One decode step's attention products over the compressed history, timed per op, A/B.

    python -m veloxquant_mlx.bench.ops --context 8192 --methods kvquant,gear --out results/x.json

For each of our cache specs, one layer's cache is filled with `--context` tokens of random K/V
(SmolLM2-135M's layer shape by default) and flushed, so every whole block beyond the exact
window sits in the compressed store. Then the two products the compressed-form attention is
made of are timed on their own (each call evaluated), in interleaved rounds:
- `scores`: `cache._scores(q)`, one decode token's query (already scaled, the query heads
  folded into `q_heads / kv_heads` rows per KV head) against the whole store;
- `values`: `cache._weighted_values(p)`, a fixed softmax `p` over the store's capacity.
With `--baseline REF`, the cache package as of git REF (`veloxquant_mlx/cache/` there, imported
under a private package name) runs the same ops on the same store: its cache is rebuilt from
the current cache's `state`, so the two store layouts must match (a mismatch is reported as
that row's `error`). Current and baseline alternate round by round, so the machine's load hits
both alike; `baseline_over_current` is the ratio of their medians (> 1: the current code is
faster) and `max_rel_diff` the largest difference of their outputs over the largest baseline
magnitude (0.0: bit-identical).
`--reference` adds, for scale, the uncompressed products (`q @ K^T`, `p @ V` in `--dtype`)
and mlx-lm's 4-bit `quantized_matmul` pair (group 64) over the same K/V.
Reported per spec and op in microseconds: min, quartiles, median, max of wall time.
`veloxquant_mlx.bench.attention` times the whole attention call (window, softmax, flush);
this module splits out the two products a method's code decides.
The shape the kvquant/gear A/Bs were taken at (B=1, 32 query heads over 8 KV heads, head_dim
128, 8K and 32K tokens, float32 and bfloat16), once per context and dtype:
    OPENBLAS_NUM_THREADS=1 python -m veloxquant_mlx.bench.ops --baseline f28ee75 \\
        --context 32768 --q-heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16 \\
        --rounds 9 --reference --out X.json
"""

from __future__ import annotations

import sys

MODULE = "veloxquant_mlx.bench.ops"
DEFAULT_METHODS = ["kvquant", "gear"]
OPS = ("scores", "values")
CACHE_PACKAGE = "veloxquant_mlx.cache"
CACHE_DIR = "veloxquant_mlx/cache"


def parse_args(argv=None):
    from veloxquant_mlx.bench.command import add_layer_shape, add_methods, parser, positive

    p = parser(MODULE, __doc__)
    add_methods(p, DEFAULT_METHODS)
    p.add_argument("--context", type=positive, default=8192, help="cached tokens (default 8192)")
    add_layer_shape(p, dtype="float32")
    p.add_argument("--rounds", type=positive, default=9, help="timed calls per op (default 9)")
    p.add_argument("--baseline", default=None, metavar="REF",
                   help="git ref whose veloxquant_mlx/cache code runs beside the current one")
    p.add_argument("--reference", action="store_true",
                   help="also time the uncompressed and mlx-lm 4-bit products")
    args = p.parse_args(argv)
    args.baseline_commit = None
    if args.baseline is not None:
        try:
            args.baseline_commit = _git("rev-parse", "--verify", f"{args.baseline}^{{commit}}").strip()
        except ValueError as exc:
            p.error(f"--baseline {args.baseline!r} is invalid: allowed is a git ref of this repository ({exc})")
    if args.q_heads % args.kv_heads:
        p.error(f"--q-heads {args.q_heads} is invalid: allowed is a multiple of --kv-heads {args.kv_heads}")
    return args


def _git(*argv: str) -> str:
    import os
    import subprocess

    # The repository this package was imported from, whatever the working directory.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(["git", "-C", root, *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def baseline_package(ref: str) -> str:
    """Import `veloxquant_mlx/cache/` as of git `ref` under a private package name; return it.

    Every .py file of the folder at `ref` but base.py is written to a temporary directory with
    its `veloxquant_mlx.cache` imports (and the registry's module-name strings) pointed at the
    private package, so the method code (cache classes, attention helpers, codebooks) is the
    ref's. base.py, config, errors and integration stay the current ones: the ref's classes
    subclass today's CompressedKVCache (the contract the A/B holds fixed), and a second
    CompressedKVCache would refuse to bind its classes' names in mlx-lm's cache module. The
    names the import binds there (base.register_with_mlx_lm) are restored afterwards, so
    mlx-lm's loader keeps finding the current classes."""
    import importlib
    import os
    import re
    import tempfile

    commit = _git("rev-parse", "--verify", f"{ref}^{{commit}}").strip()
    package = f"_vq_baseline_cache_{commit[:12]}"
    if package in sys.modules:
        return package
    root = tempfile.mkdtemp(prefix="vq_baseline_")
    os.makedirs(os.path.join(root, package))
    names = [n for n in _git("ls-tree", "--name-only", f"{commit}:{CACHE_DIR}").split() if n.endswith(".py")]
    if "__init__.py" not in names:
        raise ValueError(f"--baseline {ref!r} is invalid: {CACHE_DIR}/__init__.py does not exist there")
    pattern = re.compile(r"\bveloxquant_mlx\.cache\b(?!\.base\b)")
    for name in names:
        if name == "base.py":
            continue
        text = _git("show", f"{commit}:{CACHE_DIR}/{name}")
        with open(os.path.join(root, package, name), "w") as f:
            f.write(pattern.sub(package, text))
    sys.path.insert(0, root)
    import mlx_lm.models.cache as mlx_lm_cache

    bound = dict(vars(mlx_lm_cache))
    try:
        importlib.import_module(package)
    finally:
        for name in [n for n in vars(mlx_lm_cache) if n not in bound]:
            delattr(mlx_lm_cache, name)
        for name, value in bound.items():
            setattr(mlx_lm_cache, name, value)
    return package


def baseline_cache(cache, package: str):
    """The class of `cache` as of the baseline package, rebuilt from `cache.state`."""
    import importlib

    cls = type(cache)
    module = importlib.import_module(cls.__module__.replace(CACHE_PACKAGE, package, 1))
    return getattr(module, cls.__name__).from_state(cache.state)


def filled_cache(spec, k, v):
    """A fresh cache of `spec` holding k, v, every whole block beyond the window encoded."""
    import mlx.core as mx

    from veloxquant_mlx.bench.drive import cache_arrays
    from veloxquant_mlx.cache.base import CompressedKVCache

    cache = spec.make()
    if not isinstance(cache, CompressedKVCache):  # run() admits only ours and ablations
        raise ValueError(f"{spec.name!r} built a {type(cache).__name__}, not a compressed cache")
    cache.update_and_fetch(k, v)
    cache._flush()
    if cache.n_compressed == 0:  # the store is empty: the ops have nothing to read
        raise ValueError(
            f"--context {k.shape[2]} leaves nothing compressed for {spec.name!r} (exact window "
            f"{cache.residual_length}, blocks of {cache.block_size}): allowed is a context >= "
            f"{cache.residual_length + cache.block_size}")
    mx.eval(cache_arrays([cache]))
    return cache


def _op_calls(caches: dict, op: str, q, p) -> dict:
    if op == "scores":
        return {name: (lambda c=c: c._scores(q)) for name, c in caches.items()}
    return {name: (lambda c=c: c._weighted_values(p)) for name, c in caches.items()}


def _max_rel_diff(baseline, current, columns: int) -> float:
    """Largest |current - baseline| over the largest |baseline|, over the first `columns`
    entries of the last axis (the stored tokens; the slack beyond is masked anyway)."""
    import mlx.core as mx

    a = baseline.astype(mx.float32)[..., :columns]
    b = current.astype(mx.float32)[..., :columns]
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(a).max(), 1e-30)).item()


def _spec_rows(spec, k, v, q, args, package) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench.timing import summarize, time_calls

    row = {"label": spec.label, "kind": spec.kind}
    cache = filled_cache(spec, k, v)
    row.update(cache_nbytes=int(cache.nbytes), capacity=int(cache.capacity))
    caches = {"current": cache}
    if package is not None:
        caches["baseline"] = baseline_cache(cache, package)
    mx.random.seed(args.seed + 1)
    p = mx.softmax(mx.random.normal((1, args.kv_heads, q.shape[2], cache.capacity)) * 3, axis=-1)
    p = p.astype(q.dtype)
    for op in OPS:
        calls = _op_calls(caches, op, q, p)
        seconds = time_calls(calls, rounds=args.rounds)
        entry = {name: summarize(s, unit=1e-6) for name, s in seconds.items()}
        if "baseline" in calls:
            # values are over the head dim, scores over the stored tokens: compare all of
            # values' columns, the stored tokens' of scores.
            columns = args.context if op == "scores" else None
            entry["max_rel_diff"] = _max_rel_diff(calls["baseline"](), calls["current"](), columns)
            entry["baseline_over_current"] = entry["baseline"]["median"] / entry["current"]["median"]
        row[op] = entry
    return row


def _reference_rows(k, v, q, args) -> dict:
    """The uncompressed products and mlx-lm's 4-bit quantized_matmul pair over the same K/V."""
    import mlx.core as mx

    from veloxquant_mlx.bench.timing import summarize, time_calls

    mx.random.seed(args.seed + 1)
    p = mx.softmax(mx.random.normal((1, args.kv_heads, q.shape[2], args.context)) * 3, axis=-1)
    p = p.astype(q.dtype)
    kq = mx.quantize(k, group_size=64, bits=4)
    vq = mx.quantize(v, group_size=64, bits=4)
    calls = {
        "uncompressed scores": lambda: q @ k.swapaxes(-1, -2),
        "uncompressed values": lambda: p @ v,
        "mlx-q4 scores": lambda: mx.quantized_matmul(q, *kq, transpose=True, group_size=64, bits=4),
        "mlx-q4 values": lambda: mx.quantized_matmul(p, *vq, transpose=False, group_size=64, bits=4),
    }
    seconds = time_calls(calls, rounds=args.rounds)
    return {name: {"kind": "reference", "microseconds": summarize(s, unit=1e-6)} for name, s in seconds.items()}


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench.command import result
    from veloxquant_mlx.bench.layer_specs import parse_layer_specs
    from veloxquant_mlx.bench.speed import _error_text

    from veloxquant_mlx.errors import QuantizerConfigError

    specs = parse_layer_specs(args.methods, DEFAULT_METHODS)
    others = [s.name for s in specs if s.kind not in ("ours", "ablation")]
    if others:
        raise QuantizerConfigError(
            f"--methods: {', '.join(map(repr, others))} invalid here: allowed are our compressed "
            "caches and their ablations (fp16 and mlx-q* have no _scores/_weighted_values; "
            "--reference times their products)")
    package = baseline_package(args.baseline_commit) if args.baseline else None
    dtype = getattr(mx, args.dtype)
    keys = mx.random.split(mx.random.key(args.seed), 3)
    shape = (1, args.kv_heads, args.context, args.head_dim)
    k = mx.random.normal(shape, key=keys[0]).astype(dtype)
    v = mx.random.normal(shape, key=keys[1]).astype(dtype)
    rows_per_head = args.q_heads // args.kv_heads
    q = (mx.random.normal((1, args.kv_heads, rows_per_head, args.head_dim), key=keys[2])
         * args.head_dim ** -0.5).astype(dtype)
    rows = {}
    for spec in specs:
        try:
            rows[spec.name] = _spec_rows(spec, k, v, q, args, package)
        except Exception as exc:  # noqa: BLE001 - recorded; the other specs still run
            rows[spec.name] = {"label": spec.label, "kind": spec.kind, "error": _error_text(exc)}
    if args.reference:
        rows.update(_reference_rows(k, v, q, args))
    return result(args, rows, specs)


def main(argv=None) -> int:
    from veloxquant_mlx.bench.command import run_module

    return run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
