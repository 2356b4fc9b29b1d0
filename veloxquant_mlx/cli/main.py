"""`veloxquant`: the command line.

Subcommands live in their own modules, listed in COMMANDS (name -> module path). A module is
loaded only when present, so `demo` and `bench` appear as soon as cli/demo.py and cli/bench.py
exist. Each subcommand module provides:

    HELP: str                              one line for `veloxquant --help`
    add_arguments(parser) -> None          add its flags to its argparse (sub)parser; use
                                           common.add_json_flag(parser) for --json
    run(args) -> int                       do the work, print, return the exit code

Exit codes, for every subcommand: 0 ok; 1 findings (lint findings, decision changes in a diff,
gaps in a simulation); 2 invalid input or usage. run() may raise VeloxQuantError (PolicyError,
QuantizerConfigError) for invalid input: main prints it as one clean message (JSON with --json)
and exits 2; a traceback is never shown for bad input.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys

from veloxquant_mlx.errors import VeloxQuantError

COMMANDS = {
    "auto-config": "veloxquant_mlx.cli.auto_config",
    "policy": "veloxquant_mlx.cli.policy",
    "demo": "veloxquant_mlx.cli.demo",
    "bench": "veloxquant_mlx.cli.bench",
}

EXIT_OK, EXIT_FINDINGS, EXIT_INVALID = 0, 1, 2


def available_commands() -> dict:
    """name -> imported module, for the subcommand modules that exist."""
    out = {}
    for name, module_path in COMMANDS.items():
        if importlib.util.find_spec(module_path) is not None:
            out[name] = importlib.import_module(module_path)
    return out


def build_parser(commands: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="veloxquant",
        description="Compressed KV caches for MLX, chosen per workload by a versioned policy.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in commands.items():
        child = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(child)
        child.set_defaults(_run=module.run)
    return parser


def main(argv=None) -> int:
    parser = build_parser(available_commands())
    args = parser.parse_args(argv)  # usage errors: argparse prints usage and exits 2
    try:
        return int(args._run(args))
    except VeloxQuantError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc)}, indent=2))
        else:
            print(f"veloxquant {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_INVALID


if __name__ == "__main__":  # python -m veloxquant_mlx.cli.main
    sys.exit(main())
