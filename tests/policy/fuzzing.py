"""Random mutations of the default policy, structural (on the parsed document) and textual (on
the YAML bytes), for the fuzz tests."""

from __future__ import annotations

import copy
import random

import yaml

from veloxquant_mlx.config.fields import FIELDS, METHODS
from veloxquant_mlx.policy.facts import FACT_NAMES
from tests.policy.helpers import DEFAULT_TEXT

DEFAULT_DOC = yaml.safe_load(DEFAULT_TEXT)
_KEYS = ("id", "when", "select", "method", "params", "reason", "set", "fact", "lt", "lte", "gt",
         "gte", "eq", "ne", "all", "any", "not", "rules", "adjustments", "name", "policy_version",
         "bogus", "__class__")
_TEXT_BITS = ("{", "}", "[", "]", ":", "&a", "*a", "!!python/object:os.system", "!!binary", "#",
              "-", "'", '"', "\n", "  ", "|", ">", "%", "@", "`", "<<: ", "?", ",", "\t", "\x00",
              "\u00e9", "0x1F", ".inf", ".nan", "~", "null", "1e400", "-1", "99999999999999999999")


def _random_value(rng: random.Random, depth: int = 0):
    pool = [
        lambda: rng.randint(-5, 5), lambda: rng.choice([0, 1, 2, 3, 4, 8, 16, 32, 48, 64, 128, 256, 2048, 16384]),
        lambda: rng.random() * rng.choice([1, 0.1, 10, 1e6]), lambda: rng.choice([True, False, None]),
        lambda: rng.choice(METHODS), lambda: rng.choice(list(FIELDS)), lambda: rng.choice(FACT_NAMES),
        lambda: rng.choice(["{seq_len}", "{seq_len.real}", "{0}", "{head_dim:>5}", "{pressure_fraction:.2%}",
                            "{x[0]}", "{{literal}}", "{", "}", "{seq_len!r}", "{seq_len:99999}", ""]),
        lambda: "x" * rng.choice([0, 1, 70, 600]), lambda: 2 ** rng.randint(0, 80),
        lambda: -rng.random(), lambda: rng.choice(["1", "true", "kivi ", "KIVI"]),
    ]
    if depth < 3:
        pool += [
            lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            lambda: {rng.choice(_KEYS): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))},
            lambda: {"fact": rng.choice(FACT_NAMES), rng.choice(("lt", "gte", "eq", "ne")): _random_value(rng, 3)},
            lambda: {rng.choice(("all", "any")): [
                {"fact": rng.choice(FACT_NAMES), "gt": rng.randint(0, 5000)}]},
        ]
    return rng.choice(pool)()


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _paths(value, prefix + (key,))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _paths(value, prefix + (index,))


def _get(node, path):
    for part in path:
        node = node[part]
    return node


def _random_profile(rng: random.Random):
    """A v2 layer profile, valid or not (for mutations of a v2 policy)."""
    span = lambda: {rng.choice(["layers", "layers", "bits", "bogus"]): rng.choice([0, 1, 2, 64, 65, -1, "2", 2.5]),  # noqa: E731
                    rng.choice(["bits", "bits", "layers"]): rng.choice([1, 2, 3, 4, 8, 9, None, [4]])}
    profile = {"base": rng.choice([1, 2, 3, 4, 8, 0, "4", None, 2.0])}
    for key in rng.sample(["edges", "first", "last", "bogus"], rng.randint(0, 2)):
        profile[key] = span() if rng.random() < 0.9 else rng.choice([2, [], None])
    if rng.random() < 0.2:
        return [rng.choice([2, 3, 4, 8, 9]) for _ in range(rng.randint(0, 5))]
    return profile


def mutate_document(rng: random.Random, base_doc=None, profiles: bool = False) -> str:
    doc = copy.deepcopy(DEFAULT_DOC if base_doc is None else base_doc)
    for _ in range(rng.randint(1, 4)):
        paths = [p for p in _paths(doc) if p]
        path = rng.choice(paths)
        parent = _get(doc, path[:-1])
        key = path[-1]
        action = rng.randrange(7 if profiles else 6)
        if action == 6:  # a v2 layer profile where a parameter was (or a new one)
            params_paths = [p for p in _paths(doc) if len(p) >= 2 and p[-1] in ("params",) + METHODS
                            and isinstance(_get(doc, p), dict)]
            if params_paths:
                target = _get(doc, rng.choice(params_paths))
                target[rng.choice(["bit_width_inlier"] * 3 + ["key_bits", "gear_bits"])] = _random_profile(rng)
            continue
        if action == 0:  # delete
            del parent[key]
        elif action == 1:  # replace with a random value
            parent[key] = _random_value(rng)
        elif action == 2 and isinstance(parent, dict):  # add a key
            parent[rng.choice(_KEYS)] = _random_value(rng)
        elif action == 3 and isinstance(parent, list):  # duplicate an item (duplicate ids...)
            parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(parent[key]))
        elif action == 4 and isinstance(parent, list) and len(parent) > 1:  # reorder
            rng.shuffle(parent)
        elif action == 5 and isinstance(parent[key], dict) and "fact" in parent[key]:  # wrap a comparison
            parent[key] = {rng.choice(("not", "all", "any")): parent[key]}
            if "not" not in parent[key]:
                parent[key] = {k: [v] for k, v in parent[key].items()}
        if not doc:
            break
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def mutate_text(rng: random.Random, base_text: str = DEFAULT_TEXT) -> str:
    text = base_text
    for _ in range(rng.randint(1, 5)):
        action = rng.randrange(4)
        at = rng.randrange(len(text) + 1)
        if action == 0:
            text = text[:at] + text[at + rng.randint(1, 12):]
        elif action == 1:
            text = text[:at] + rng.choice(_TEXT_BITS) + text[at:]
        elif action == 2:
            lines = text.split("\n")
            i = rng.randrange(len(lines))
            lines.insert(i, lines[rng.randrange(len(lines))])
            text = "\n".join(lines)
        else:
            text = text.replace(rng.choice(["2048", "0.75", "kivi", "gear_bits", "seq_len", "id:"]),
                                rng.choice(["2047", "-1", "kiwi", "{seq_len}", "id:", "&a x", "*a"]), 1)
    return text


def mutated_policy(seed: int) -> str:
    rng = random.Random(seed)
    return mutate_document(rng) if rng.random() < 0.6 else mutate_text(rng)


def mutated_policy_v2(seed: int, text: str) -> str:
    """A mutation of a v2 policy's text: v1's mutations plus layer profiles put in params."""
    rng = random.Random(seed)
    if rng.random() < 0.6:
        return mutate_document(rng, yaml.safe_load(text), profiles=True)
    return mutate_text(rng, text)


def compiled_or_none(text: str, seed: int):
    """The compiled policy, or None when it is refused with a PolicyError naming its file."""
    from veloxquant_mlx import PolicyError
    from veloxquant_mlx.policy import compile_policy_text

    try:
        return compile_policy_text(text, f"fuzz-{seed}.yaml")
    except PolicyError as exc:
        assert str(exc).startswith(f"fuzz-{seed}.yaml"), str(exc)
        return None


def run_fuzz(seeds, run_case, policy_text) -> dict:
    """Count run_case(seed)'s outcomes ("invalid" / "valid"); any exception other than an
    assertion fails the test with the seed and the mutated policy (policy_text(seed))."""
    import pytest

    outcomes = {"invalid": 0, "valid": 0}
    for seed in seeds:
        try:
            outcomes[run_case(seed)] += 1
        except AssertionError:
            raise
        except Exception as exc:  # noqa: BLE001 - the point of the fuzz tests
            pytest.fail(f"seed {seed}: {type(exc).__name__}: {exc}\n--- policy ---\n{policy_text(seed)}")
    return outcomes
