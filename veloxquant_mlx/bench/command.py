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


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed is an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: allowed is an integer >= 1")
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
