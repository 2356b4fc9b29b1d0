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


def mutate_document(rng: random.Random) -> str:
    doc = copy.deepcopy(DEFAULT_DOC)
    for _ in range(rng.randint(1, 4)):
        paths = [p for p in _paths(doc) if p]
        path = rng.choice(paths)
        parent = _get(doc, path[:-1])
        key = path[-1]
        action = rng.randrange(6)
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


def mutate_text(rng: random.Random) -> str:
    text = DEFAULT_TEXT
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
