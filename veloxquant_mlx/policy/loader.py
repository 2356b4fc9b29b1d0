"""Stage 1: read a policy file into plain Python data, safely, remembering where each node was.

Only YAML's JSON-like core is accepted: mappings with string keys, sequences, and scalars that
are null, bool, int, float or str. Every tag outside that set (`!!python/object`, `!!binary`,
`!!timestamp`, custom tags), merge keys (`<<`), duplicate keys and multi-document streams are
refused. The document is composed with PyYAML's safe loader (no constructor ever runs on it) and
converted here node by node, which bounds the work an alias bomb can cause: alias uses are
counted, and the expanded tree's size and depth are capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import yaml

from veloxquant_mlx.errors import PolicyError

MAX_BYTES = 256 * 1024
MAX_DEPTH = 32
MAX_ALIASES = 32
MAX_NODES = 20_000

_SCALAR_TAGS = {
    "tag:yaml.org,2002:null",
    "tag:yaml.org,2002:bool",
    "tag:yaml.org,2002:int",
    "tag:yaml.org,2002:float",
    "tag:yaml.org,2002:str",
}
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MAP_TAG = "tag:yaml.org,2002:map"


@dataclass(frozen=True)
class LoadedDocument:
    """A policy document: its data, its text's sha256 and where each node sat in the file."""

    source: str  # the file name used in messages
    data: object
    marks: dict  # path tuple -> (line, column), 1-based; value nodes
    key_marks: dict  # path tuple -> (line, column) of the mapping key that names it

    def where(self, path: tuple) -> str:
        """`file:line:column` of the node at path, or of its nearest ancestor that has a mark."""
        probe = tuple(path)
        while True:
            mark = self.marks.get(probe)
            if mark is not None:
                return f"{self.source}:{mark[0]}:{mark[1]}"
            if not probe:
                return self.source
            probe = probe[:-1]

    def where_key(self, path: tuple) -> str:
        mark = self.key_marks.get(tuple(path))
        return f"{self.source}:{mark[0]}:{mark[1]}" if mark else self.where(path)


def format_path(path) -> str:
    """rules[2].select.params.kivi_group_size style; the root is `<root>`."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "<root>"


# libyaml's composer when present (fast; composition builds nodes only, runs no constructor),
# else PyYAML's pure-Python one. Aliases stay shared nodes until _Converter expands them.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _Refused(Exception):
    def __init__(self, mark, message: str):
        super().__init__(message)
        self.mark = mark
        self.message = message


def _mark(node) -> tuple[int, int]:
    return (node.start_mark.line + 1, node.start_mark.column + 1)


class _Converter:
    def __init__(self, loader: yaml.SafeLoader):
        self.loader = loader
        self.marks: dict = {}
        self.key_marks: dict = {}
        self.nodes = 0
        self.seen: set = set()  # ids of nodes already converted: meeting one again is an alias
        self.aliases = 0

    def convert(self, node, path: tuple, depth: int):
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _Refused(node.start_mark, f"document expands to more than {MAX_NODES} nodes: refused")
        if depth > MAX_DEPTH:
            raise _Refused(node.start_mark, f"nesting deeper than {MAX_DEPTH} levels: refused")
        if id(node) in self.seen:
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                raise _Refused(node.start_mark, f"more than {MAX_ALIASES} uses of YAML aliases: "
                               "refused (alias bomb guard)")
        self.seen.add(id(node))
        self.marks.setdefault(path, _mark(node))
        if isinstance(node, yaml.ScalarNode):
            if node.tag not in _SCALAR_TAGS:
                raise _Refused(node.start_mark, f"YAML tag {node.tag!r} is not allowed: a policy holds "
                               "only null, booleans, numbers, strings, lists and mappings")
            try:
                value = self.loader.construct_object(node, deep=True)
            except (ValueError, yaml.YAMLError) as exc:  # e.g. an int of 10,000 digits
                raise _Refused(node.start_mark, f"scalar {node.value[:40]!r} is not allowed: {exc}")
            if isinstance(value, float) and not math.isfinite(value):
                raise _Refused(node.start_mark, f"{node.value!r} is not allowed: numbers must be finite")
            return value
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                raise _Refused(node.start_mark, f"YAML tag {node.tag!r} is not allowed: a policy holds "
                               "only null, booleans, numbers, strings, lists and mappings")
            return [self.convert(item, path + (i,), depth + 1) for i, item in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP_TAG:
                raise _Refused(node.start_mark, f"YAML tag {node.tag!r} is not allowed: a policy holds "
                               "only null, booleans, numbers, strings, lists and mappings")
            out: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise _Refused(key_node.start_mark, "YAML merge keys (<<) are not allowed")
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                    raise _Refused(key_node.start_mark, "mapping keys must be plain strings")
                key = key_node.value
                if key in out:
                    raise _Refused(key_node.start_mark, f"duplicate key {key!r} at {format_path(path)}")
                self.key_marks[path + (key,)] = _mark(key_node)
                out[key] = self.convert(value_node, path + (key,), depth + 1)
            return out
        raise _Refused(node.start_mark, f"unsupported YAML node {type(node).__name__}")


def _flow_depth_guard(text: str, source: str) -> None:
    """Refuse deep flow nesting ([[[[... or {{{{...) before PyYAML sees it: its pure-Python
    scanner looks ahead over every open bracket (quadratic time) before the composer could stop
    it. Brackets inside strings count too: a string with more than MAX_DEPTH unbalanced opening
    brackets is refused, a price paid for a linear-time guard."""
    depth = 0
    line, column = 1, 0
    for char in text:
        column += 1
        if char == "\n":
            line, column = line + 1, 0
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise PolicyError(f"{source}:{line}:{column}: nesting deeper than {MAX_DEPTH} levels: refused")
        elif char in "]}" and depth:
            depth -= 1


def parse_policy_text(text: str | bytes, source: str = "<policy>") -> LoadedDocument:
    """Parse a policy's text; PolicyError (with file:line:column) on anything not allowed."""
    size = len(text.encode("utf-8") if isinstance(text, str) else text)
    if size > MAX_BYTES:
        raise PolicyError(f"{source}: {size} bytes is too large: allowed is at most {MAX_BYTES} bytes")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(f"{source}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    _flow_depth_guard(text, source)
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise PolicyError(f"{source}: the document is empty: a policy is a mapping with "
                              "policy_version, name and rules")
        converter = _Converter(loader)
        data = converter.convert(node, (), 0)
    except _Refused as exc:
        raise PolicyError(f"{source}:{exc.mark.line + 1}:{exc.mark.column + 1}: {exc.message}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = exc.problem or exc.context or "malformed YAML"
        raise PolicyError(f"{where}: malformed YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"{source}: malformed YAML: {exc}") from None
    except RecursionError:
        raise PolicyError(f"{source}: nesting too deep: refused") from None
    finally:
        loader.dispose()
    return LoadedDocument(source, data, converter.marks, converter.key_marks)
