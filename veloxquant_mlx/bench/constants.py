"""`--set MODULE.NAME=VALUE` for the measurement modules: a cache module's integer or boolean
constant (a kernel's register budget, a prefill switch) set before timing, so two runs time two
settings of the shipped code. A name that is not such a constant is an error: a typo must never
time the default silently. Kernel factories key their caches (and MLX's CUDA kernel cache its
template arguments) on these constants, so a setting builds its own kernel."""

from __future__ import annotations

import importlib

HELP = ("set an integer or boolean constant of a veloxquant_mlx.cache module before timing, "
        "e.g. fused_decode_rotated.MAX_VALUE_SUMS=64 or prefill_pieces.SYNC=0; repeatable")


def parse_setting(text: str) -> tuple:
    """'module.NAME=VALUE' -> (module, NAME, value), the module one of veloxquant_mlx.cache's,
    NAME an int or bool constant it has, VALUE an int (0 / 1 for a bool)."""
    target, eq, raw = text.partition("=")
    module_name, dot, name = target.strip().rpartition(".")
    if not eq or not dot or not name:
        raise ValueError(f"{text!r}: expected MODULE.NAME=VALUE, e.g. fused_decode.MAX_LANE_ACCUMULATORS=64")
    try:
        module = importlib.import_module(f"veloxquant_mlx.cache.{module_name}")
    except ImportError:
        raise ValueError(f"{text!r}: no module veloxquant_mlx.cache.{module_name}") from None
    current = getattr(module, name, None)
    if isinstance(current, bool):
        if raw.strip() not in ("0", "1"):
            raise ValueError(f"{text!r}: {name} is a boolean: allowed are 0 and 1")
        return module, name, raw.strip() == "1"
    if not isinstance(current, int):
        raise ValueError(f"{text!r}: veloxquant_mlx.cache.{module_name} has no integer or boolean constant {name}")
    try:
        return module, name, int(raw)
    except ValueError:
        raise ValueError(f"{text!r}: {raw!r} is not an integer") from None


def add_set_option(parser) -> None:
    """A measurement module's repeatable `--set MODULE.NAME=VALUE` option."""
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE", help=HELP)


def parsed_settings(parser, texts) -> list:
    """The texts of `--set` as (module, NAME, value); a bad one is `parser`'s usage error."""
    try:
        return [parse_setting(x) for x in texts]
    except ValueError as exc:
        parser.error(f"--set: {exc}")


def apply_settings(settings) -> dict:
    """Set each (module, NAME, value); -> {"module.NAME": {"default": old, "set": new}} for the
    result file."""
    applied = {}
    for module, name, value in settings:
        applied[f"{module.__name__}.{name}"] = {"default": getattr(module, name), "set": value}
        setattr(module, name, value)
    return applied
