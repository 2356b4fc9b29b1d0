"""Stage 3: turn a schema-valid document into a CompiledPolicy.

Checks the schema cannot express, each with file:line:column and the node's path: every
parameter is owned by the method it is given for and in the range KVCacheConfig allows (read
from config/fields.py, the same registry KVCacheConfig uses); ids are unique across rules and
adjustments; reason templates name facts only; numbers in comparisons are finite. Conditions
are compiled to closures (the evaluator runs them) and kept as a tree (lint reads it).
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field

from veloxquant_mlx.config.fields import FIELDS, METHOD_RANGES, fields_of
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.errors import PolicyError, QuantizerConfigError
from veloxquant_mlx.policy.loader import LoadedDocument, format_path, parse_policy_text
from veloxquant_mlx.policy.templates import TemplateError, compile_template, template_facts
from veloxquant_mlx.policy import versions

OPERATORS = {
    "lt": operator.lt, "lte": operator.le, "gt": operator.gt,
    "gte": operator.ge, "eq": operator.eq, "ne": operator.ne,
}
OP_SYMBOLS = {"lt": "<", "lte": "<=", "gt": ">", "gte": ">=", "eq": "==", "ne": "!="}


@dataclass(frozen=True)
class Condition:
    """A condition tree: kind is "cmp" (fact + checks), "all", "any", "not" or "true"."""

    kind: str
    fact: str | None = None
    checks: tuple = ()  # ((op_name, threshold), ...) for "cmp"
    children: tuple = ()

    def facts(self) -> tuple:
        if self.kind == "cmp":
            return (self.fact,)
        out: dict = {}
        for child in self.children:
            out.update(dict.fromkeys(child.facts()))
        return tuple(out)

    def thresholds(self) -> dict:
        """fact -> set of thresholds used anywhere in the tree (lint cuts bands there)."""
        out: dict = {}
        if self.kind == "cmp":
            out[self.fact] = {value for _, value in self.checks}
        for child in self.children:
            for name, values in child.thresholds().items():
                out.setdefault(name, set()).update(values)
        return out

    def describe(self) -> str:
        if self.kind == "true":
            return "always"
        if self.kind == "cmp":
            return " and ".join(f"{self.fact} {OP_SYMBOLS[op]} {value}" for op, value in self.checks)
        if self.kind == "not":
            return f"not ({self.children[0].describe()})"
        joiner = " and " if self.kind == "all" else " or "
        return "(" + joiner.join(child.describe() for child in self.children) + ")"


def _compile_test(cond: Condition):
    """A closure facts -> bool. A comparison against a null fact is false."""
    if cond.kind == "true":
        return lambda facts: True
    if cond.kind == "cmp":
        name = cond.fact
        checks = tuple((OPERATORS[op], value) for op, value in cond.checks)
        if len(checks) == 1:
            (op, value), = checks

            def test_one(facts, name=name, op=op, value=value):
                fact = facts[name]
                return fact is not None and op(fact, value)

            return test_one

        def test_many(facts, name=name, checks=checks):
            fact = facts[name]
            if fact is None:
                return False
            for op, value in checks:
                if not op(fact, value):
                    return False
            return True

        return test_many
    tests = tuple(_compile_test(child) for child in cond.children)
    if cond.kind == "not":
        inner = tests[0]
        return lambda facts: not inner(facts)
    if cond.kind == "all":
        return lambda facts: all(test(facts) for test in tests)
    return lambda facts: any(test(facts) for test in tests)


@dataclass(frozen=True)
class CompiledRule:
    id: str
    index: int
    condition: Condition
    method: str
    params: dict  # the parameters the rule sets (not the method's defaults)
    reason: tuple  # compiled template pieces
    facts: tuple  # facts the condition and reason read (shown in the trail)
    test: object = field(repr=False, compare=False, default=None)


@dataclass(frozen=True)
class CompiledAdjustment:
    id: str
    index: int
    condition: Condition
    sets: dict  # method -> {param: value}
    reason: tuple
    facts: tuple
    test: object = field(repr=False, compare=False, default=None)


@dataclass(frozen=True, eq=False)
class CompiledPolicy:
    name: str
    version: int
    sha256: str
    source: str
    description: str
    rules: tuple
    adjustments: tuple
    # (rule index, indices of the adjustments that applied) -> KVCacheConfig, and
    # ("text", rule index, indices) -> the reason's outcome text; filled lazily. Configs are
    # frozen, so one instance per combination is shared by every decision.
    config_cache: dict = field(default_factory=dict, repr=False)

    def thresholds(self) -> dict:
        out: dict = {}
        for item in (*self.rules, *self.adjustments):
            for name, values in item.condition.thresholds().items():
                out.setdefault(name, set()).update(values)
        return out

    def config_for(self, rule_index: int, applied: tuple) -> KVCacheConfig:
        key = (rule_index, applied)
        config = self.config_cache.get(key)
        if config is None:
            rule = self.rules[rule_index]
            params = dict(rule.params)
            for index in applied:
                params.update(self.adjustments[index].sets[rule.method])
            try:
                config = KVCacheConfig(method=rule.method, **params)
            except QuantizerConfigError as exc:  # each value was checked; a guard, not a path
                raise PolicyError(f"{self.source}: rule {rule.id}: {exc}") from None
            self.config_cache[key] = config
        return config


class _Compiler:
    def __init__(self, doc: LoadedDocument):
        self.doc = doc
        self.ids: dict = {}  # id -> path of its first use

    def fail(self, path: tuple, message: str, key: bool = False):
        where = self.doc.where_key(path) if key else self.doc.where(path)
        raise PolicyError(f"{where}: {format_path(path)}: {message}")

    def claim_id(self, ident: str, path: tuple) -> None:
        if ident in self.ids:
            first = self.ids[ident]
            self.fail(path, f"{ident!r} is a duplicate id: already used by {format_path(first[:-1])} "
                            f"({self.doc.where(first)}); ids must be unique across rules and adjustments")
        self.ids[ident] = path

    def condition(self, node, path: tuple) -> Condition:
        if node is None:
            return Condition("true")
        if "fact" in node:
            checks = tuple((op, node[op]) for op in OPERATORS if op in node)
            return Condition("cmp", fact=node["fact"], checks=checks)
        (kind, value), = node.items()
        if kind == "not":
            return Condition("not", children=(self.condition(value, path + ("not",)),))
        return Condition(kind, children=tuple(
            self.condition(child, path + (kind, i)) for i, child in enumerate(value)))

    def params(self, method: str, params: dict, path: tuple) -> dict:
        own = fields_of(method)
        for name, value in params.items():
            at = path + (name,)
            spec = FIELDS[name]
            if method not in spec.defaults:
                self.fail(at, f"does not apply to method {method}: it belongs to "
                              f"{', '.join(spec.defaults)}; the parameters of {method} are "
                              f"{', '.join(own)}", key=True)
            check, allowed = METHOD_RANGES.get((method, name), (spec.check, spec.allowed))
            if value is None and spec.defaults[method] is None:
                continue
            if spec.per_layer and isinstance(value, list):
                for i, item in enumerate(value):
                    if not check(item):
                        self.fail(at + (i,), f"{item!r} is invalid for {method}: allowed is {allowed}")
                continue
            if not check(value):
                self.fail(at, f"{value!r} is invalid for {method}: allowed is {allowed}")
        try:  # the same constructor a decision uses: a last guard that they agree
            KVCacheConfig(method=method, **params)
        except QuantizerConfigError as exc:
            self.fail(path, str(exc))
        return {k: tuple(v) if isinstance(v, list) else v for k, v in params.items()}

    def template(self, text: str, path: tuple) -> tuple:
        try:
            return compile_template(text)
        except TemplateError as exc:
            self.fail(path, f"{text!r} is not a valid reason template: {exc}")

    def rule(self, node: dict, index: int) -> CompiledRule:
        path = ("rules", index)
        self.claim_id(node["id"], path + ("id",))
        cond = self.condition(node.get("when"), path + ("when",))
        method = node["select"]["method"]
        params = self.params(method, node["select"].get("params", {}), path + ("select", "params"))
        reason = self.template(node["reason"], path + ("reason",))
        facts = tuple(dict.fromkeys((*cond.facts(), *template_facts(reason))))
        return CompiledRule(node["id"], index, cond, method, params, reason, facts, _compile_test(cond))

    def adjustment(self, node: dict, index: int) -> CompiledAdjustment:
        path = ("adjustments", index)
        self.claim_id(node["id"], path + ("id",))
        cond = self.condition(node["when"], path + ("when",))
        sets = {method: self.params(method, params, path + ("set", method))
                for method, params in node["set"].items()}
        reason = self.template(node["reason"], path + ("reason",))
        facts = tuple(dict.fromkeys((*cond.facts(), *template_facts(reason))))
        return CompiledAdjustment(node["id"], index, cond, sets, reason, facts, _compile_test(cond))


def compile_v1(doc: LoadedDocument, sha256: str) -> CompiledPolicy:
    data = doc.data
    compiler = _Compiler(doc)
    rules = tuple(compiler.rule(node, i) for i, node in enumerate(data["rules"]))
    adjustments = tuple(compiler.adjustment(node, i) for i, node in enumerate(data.get("adjustments", [])))
    return CompiledPolicy(
        name=data["name"], version=data["policy_version"], sha256=sha256, source=doc.source,
        description=data.get("description", ""), rules=rules, adjustments=adjustments,
    )


_COMPILERS = {"compile_v1": compile_v1}


def compile_policy_text(text: str | bytes, source: str = "<policy>") -> CompiledPolicy:
    """parse -> pick the version -> validate against its schema -> compile. PolicyError on any
    problem; nothing in the text is ever executed."""
    raw = text.encode("utf-8") if isinstance(text, str) else text
    sha256 = hashlib.sha256(raw).hexdigest()
    doc = parse_policy_text(raw, source)
    version = versions.version_of(doc)
    versions.validate_schema(doc, version)
    return _COMPILERS[version.compiler](doc, sha256)
