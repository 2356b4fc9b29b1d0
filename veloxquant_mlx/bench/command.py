"""What every measurement module's command line shares: the parser's common options, the
OpenBLAS re-exec, and one way to write the result (report.header()'s command, date and
machine first, then the figures; report.write_json's atomic write; a copy on stdout).
"""

from __future__ import annotations

import argparse
import json
import sys

from veloxquant_mlx.bench import report


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON output path (default: stdout only)")
    p.add_argument("--no-openblas", action="store_true",
                   help="do not re-run with Debian's OpenBLAS preloaded on Linux")
    return p


def add_methods(p: argparse.ArgumentParser, default: list[str]) -> None:
    p.add_argument("--methods", default="default",
                   help="comma list of cache specs as for `veloxquant bench` (fp16, mlx-q4, "
                        "kivi:bit_width_inlier=4, ...), plus the ablations of "
                        f"veloxquant_mlx.bench.ablations; 'default' = {','.join(default)}")


def add_layer_shape(p: argparse.ArgumentParser, *, dtype: str) -> None:
    """One attention layer's shape, SmolLM2-135M's by default (9 query heads over 3 KV heads,
    head_dim 64), the K/V dtype and the random seed."""
    p.add_argument("--q-heads", type=positive, default=9, help="query heads (default 9)")
    p.add_argument("--kv-heads", type=positive, default=3, help="KV heads (default 3)")
    p.add_argument("--head-dim", type=positive, default=64, help="(default 64)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=dtype,
                   help=f"K/V dtype (default {dtype})")
    p.add_argument("--seed", type=int, default=0)


def int_list(p: argparse.ArgumentParser, option: str, text: str, valid, allowed: str, required: bool) -> list[int]:
    """`option`'s comma list of integers, each passing `valid` (at least one where `required`),
    else `p`'s usage error naming the option, its text and what is `allowed`."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = None
    if values is None or (required and not values) or not all(valid(v) for v in values):
        p.error(f"{option} {text!r} is invalid: allowed is {allowed}")
    return values


def name_list(p: argparse.ArgumentParser, option: str, text: str, allowed, note: str = "") -> list[str]:
    """`option`'s comma list of names, at least one, each in `allowed`, else `p`'s usage error
    naming the unknown ones and listing `allowed` (then `note`, where given)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown or not names:
        p.error(f"{option}: {unknown or 'none given'} is invalid; allowed are {', '.join(allowed)}{note}")
    return names


def positive(text: str) -> int:
    from veloxquant_mlx.cli.common import _non_negative

    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0 is invalid: allowed is an integer >= 1")
    return value


def start(args) -> dict:
    """Re-exec with OpenBLAS when asked and useful, then the result's header."""
    if not args.no_openblas:
        from veloxquant_mlx.bench.blas import reexec_with_openblas

        reexec_with_openblas()
    return report.header()


def finish(result: dict, out: str | None) -> int:
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if out:
        report.write_json(result, out)
        print(f"wrote {out}", file=sys.stderr)
    return 0


def usage_error(module: str, message: str) -> int:
    print(f"{module}: {message}", file=sys.stderr)
    return 2


def result(args, rows: dict, specs=None, **settings) -> dict:
    """The figures part of a result: `settings` (every option but --out, --no-openblas and
    --methods, plus `settings`), the `specs` when given (as parsed), and the `results` rows."""
    options = {k: v for k, v in vars(args).items() if k not in ("out", "no_openblas", "methods")}
    out = {"settings": {**options, **settings}}
    if specs is not None:
        from veloxquant_mlx.bench.layer_specs import describe

        out["specs"] = describe(specs)
    out["results"] = rows
    return out


def run_module(module: str, parse_args, run, argv=None) -> int:
    """A measurement module's main: parse, re-exec for OpenBLAS, run, write. A bad cache spec
    (found when `run` parses --methods) is a usage error, exit status 2, nothing written."""
    from veloxquant_mlx.errors import QuantizerConfigError

    args = parse_args(argv)
    header = start(args)
    try:
        result = run(args)
    except QuantizerConfigError as exc:
        return usage_error(module, str(exc))
    return finish({**header, **result}, args.out)
