"""The registry of KVCacheConfig's fields: which methods own each one, its default per method
and what values are allowed. KVCacheConfig and the policy compiler both read it, so a parameter
a policy names is checked against the same rules as one given in code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

METHODS = ("turboquant_rvq", "kivi", "kvquant", "gear", "xquant", "minicache", "pyramidkv")


@dataclass(frozen=True)
class FieldSpec:
    name: str
    defaults: dict  # method -> default value; the keys are the methods that own the field
    allowed: str  # human text of what is allowed, used in error messages
    check: Callable[[object], bool]
    per_layer: bool = False  # may be a list with one entry per attention layer


def _int_in(values) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v in values


def _int_at_least(low: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _fraction(low: float, high: float) -> Callable[[object], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high


_GROUPS = (32, 64, 128)
_KIVI_BITS = (2, 3, 4, 8)

FIELDS: dict[str, FieldSpec] = {
    spec.name: spec
    for spec in (
        FieldSpec(
            "bit_width_inlier",
            {"turboquant_rvq": 4, "kivi": 2, "xquant": 2},
            "turboquant_rvq: 1..4 total bits per coordinate; kivi: one of 2, 3, 4, 8; "
            "xquant: one of 2, 3, 4; an int or a list with one int per attention layer",
            _int_in(range(1, 9)),
            per_layer=True,
        ),
        FieldSpec(
            "key_bits",
            {"turboquant_rvq": None, "kivi": None},
            "None (use bit_width_inlier) or bits for keys alone, same range as bit_width_inlier",
            _int_in(range(1, 9)),
        ),
        FieldSpec(
            "value_bits",
            {"turboquant_rvq": None, "kivi": None},
            "None (use bit_width_inlier) or bits for values alone, same range as bit_width_inlier",
            _int_in(range(1, 9)),
        ),
        FieldSpec("seed", {"turboquant_rvq": 0, "xquant": 0}, "an integer >= 0", _int_at_least(0)),
        FieldSpec("kivi_group_size", {"kivi": 32}, f"one of {_GROUPS}", _int_in(_GROUPS)),
        FieldSpec(
            "kivi_residual_length", {"kivi": 128}, "an integer >= 0", _int_at_least(0)
        ),
        FieldSpec("kvquant_bits", {"kvquant": 3}, "one of 2, 3, 4", _int_in((2, 3, 4))),
        FieldSpec(
            "kvquant_outlier_fraction",
            {"kvquant": 0.01},
            "a number from 0 to 0.1",
            _fraction(0.0, 0.1),
        ),
        FieldSpec("kvquant_group_size", {"kvquant": 32}, f"one of {_GROUPS}", _int_in(_GROUPS)),
        FieldSpec("gear_bits", {"gear": 2}, "one of 2, 3, 4, 8", _int_in((2, 3, 4, 8))),
        FieldSpec("gear_group_size", {"gear": 32}, f"one of {_GROUPS}", _int_in(_GROUPS)),
        FieldSpec("gear_rank", {"gear": 4}, "an integer >= 0", _int_at_least(0)),
        FieldSpec(
            "gear_outlier_fraction", {"gear": 0.01}, "a number from 0 to 0.1", _fraction(0.0, 0.1)
        ),
        FieldSpec("xquant_group_size", {"xquant": 32}, f"one of {_GROUPS}", _int_in(_GROUPS)),
        FieldSpec(
            "xquant_residual_length",
            {"xquant": 128},
            "an integer >= 0 (most recent tokens kept exact)",
            _int_at_least(0),
        ),
        FieldSpec(
            "xquant_share_from",
            {"xquant": 0.0},
            "a number from 0 to 1 (depth from which layer pairs share codes; 1 shares none)",
            _fraction(0.0, 1.0),
        ),
        FieldSpec(
            "xquant_eta",
            {"xquant": None},
            "None (0.05 at 2 bits, 0 at 3 and 4) or a number from 0 to 0.45 (data-free "
            "calibration: how far the outer quantization levels move in)",
            _fraction(0.0, 0.45),
        ),
        FieldSpec(
            "minicache_start_fraction",
            {"minicache": 0.5},
            "a number from 0 to 1 (where in depth merging starts)",
            _fraction(0.0, 1.0),
        ),
        FieldSpec(
            "minicache_threshold",
            {"minicache": 0.9},
            "a number from -1 to 1 (angular similarity above which a token merges)",
            _fraction(-1.0, 1.0),
        ),
        FieldSpec(
            "minicache_bits",
            {"minicache": None},
            "None (merged directions in fp16) or one of 2, 3, 4, 8 (quantized per token, "
            "groups of 32 channels)",
            _int_in((2, 3, 4, 8)),
        ),
        FieldSpec(
            "minicache_retain_slots",
            {"minicache": 4},
            "one of 0, 1, 2, 4, 8, 16 (tokens per 32 per head that may stay unmerged)",
            _int_in((0, 1, 2, 4, 8, 16)),
        ),
        FieldSpec(
            "minicache_residual_length",
            {"minicache": 0},
            "an integer >= 0 (most recent tokens kept exact before merging)",
            _int_at_least(0),
        ),
        FieldSpec(
            "pyramidkv_budget",
            {"pyramidkv": 1024},
            "an integer >= 16 (mean tokens kept per layer)",
            _int_at_least(16),
        ),
        FieldSpec(
            "pyramidkv_window", {"pyramidkv": 32}, "an integer >= 1 (observation window)", _int_at_least(1)
        ),
        FieldSpec(
            "pyramidkv_beta",
            {"pyramidkv": 20},
            "an integer >= 1 (the top layer keeps (budget - window) / beta selected tokens)",
            _int_at_least(1),
        ),
        FieldSpec(
            "pyramidkv_kernel",
            {"pyramidkv": 5},
            "an odd integer >= 1 (average-pooling width over the attention votes)",
            lambda v: _int_at_least(1)(v) and v % 2 == 1,
        ),
    )
}

# Method-specific ranges that are narrower than the field's shared check.
METHOD_RANGES: dict[tuple[str, str], tuple[Callable[[object], bool], str]] = {
    ("turboquant_rvq", "bit_width_inlier"): (_int_in((1, 2, 3, 4)), "1..4"),
    ("turboquant_rvq", "key_bits"): (_int_in((1, 2, 3, 4)), "1..4"),
    ("turboquant_rvq", "value_bits"): (_int_in((1, 2, 3, 4)), "1..4"),
    ("kivi", "bit_width_inlier"): (_int_in(_KIVI_BITS), "one of 2, 3, 4, 8"),
    ("kivi", "key_bits"): (_int_in(_KIVI_BITS), "one of 2, 3, 4, 8"),
    ("kivi", "value_bits"): (_int_in(_KIVI_BITS), "one of 2, 3, 4, 8"),
    ("xquant", "bit_width_inlier"): (_int_in((2, 3, 4)), "one of 2, 3, 4"),
}


def fields_of(method: str) -> tuple[str, ...]:
    """The fields a method owns, in registry order."""
    return tuple(name for name, spec in FIELDS.items() if method in spec.defaults)
