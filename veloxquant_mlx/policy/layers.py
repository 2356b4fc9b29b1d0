"""Per-layer bit widths in a policy (version 2): layer profiles, resolved against n_layers.

A v2 rule (or adjustment) may give `bit_width_inlier` -- the only per-layer field of
KVCacheConfig (config/fields.py: per_layer=True) -- in one of three shapes:

    bit_width_inlier: 2                                # every attention layer
    bit_width_inlier: {base: 2, edges: {layers: 2, bits: 4}}
    bit_width_inlier: {base: 2, first: {layers: 1, bits: 4}, last: {layers: 3, bits: 3}}
    bit_width_inlier: [4, 2, 2, 4]                     # explicit: one entry per attention layer

A profile resolves, for a workload with n attention layers, to a list of n bit widths:
layer i (0-based) gets `first.bits` if i < first.layers, else `last.bits` if
i >= n - last.layers, else `base`. `edges: S` is shorthand for `first: S, last: S`.

Documented resolution rules (a profile resolves for every valid n_layers, never crashes):
  - A model with fewer layers than first.layers + last.layers: the spans overlap and the
    overlapping layers take `first.bits` (with `edges` both are equal, so every layer gets the
    edge bits: a 1- or 2-layer model with edges of 2 layers is all edge bits).
  - n_layers > MAX_RESOLVED_LAYERS (4096; the deepest released models have ~130 layers): the
    profile resolves to its `base` as a single int instead of a list of millions of entries.
An explicit list resolves only when n_layers equals its length; a rule that can decide a
workload with another n_layers is a lint finding (`layer-list`) with a witness, and deciding
such a workload raises PolicyError naming the rule, never a late crash in a cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from veloxquant_mlx.errors import PolicyError

MAX_RESOLVED_LAYERS = 4096
MAX_SPAN_LAYERS = 64  # the schema's bound on first/last/edges.layers


@dataclass(frozen=True)
class LayerProfile:
    """bit_width_inlier per attention layer. kind "spans" (base + first/last spans) or
    "list" (explicit values, one per layer)."""

    kind: str
    base: int | None = None
    first: tuple = (0, None)  # (layers, bits)
    last: tuple = (0, None)
    values: tuple = ()  # kind "list"
    spec: object = field(default=None, compare=False)  # the YAML node as written (JSON output)

    def resolve(self, n_layers: int):
        """A tuple with one bit width per attention layer (or `base` past MAX_RESOLVED_LAYERS).
        PolicyError for an explicit list of another length."""
        if self.kind == "list":
            if n_layers != len(self.values):
                raise PolicyError(f"an explicit bit_width_inlier list has {len(self.values)} entries "
                                  f"but the workload has n_layers={n_layers}: allowed is one entry "
                                  "per attention layer (use a profile {base: ..., edges: ...} to "
                                  "fit any depth)")
            return self.values
        if n_layers > MAX_RESOLVED_LAYERS:
            return self.base
        first_n, first_bits = self.first
        last_n, last_bits = self.last
        out = []
        for i in range(n_layers):
            if i < first_n:
                out.append(first_bits)
            elif i >= n_layers - last_n:
                out.append(last_bits)
            else:
                out.append(self.base)
        return tuple(out)

    def bit_values(self) -> tuple:
        """Every bit width the profile can produce (for range checks at load time)."""
        if self.kind == "list":
            return tuple(dict.fromkeys(self.values))
        found = [self.base]
        for layers, bits in (self.first, self.last):
            if layers:
                found.append(bits)
        return tuple(dict.fromkeys(found))

    def describe(self) -> str:
        """The profile as written, in words (independent of n_layers)."""
        if self.kind == "list":
            return compact_layers(self.values)
        parts = [f"{self.base}"]
        if self.first == self.last and self.first[0]:
            parts.append(f"{self.first[1]} on the first and last {self.first[0]} layer(s)")
        else:
            if self.first[0]:
                parts.append(f"{self.first[1]} on the first {self.first[0]} layer(s)")
            if self.last[0]:
                parts.append(f"{self.last[1]} on the last {self.last[0]} layer(s)")
        return ", ".join(parts)


def profile_from_node(node) -> LayerProfile:
    """A LayerProfile from a schema-valid YAML node (dict profile or list)."""
    if isinstance(node, list):
        return LayerProfile("list", values=tuple(node), spec=list(node))
    edges = node.get("edges")
    first = edges if edges is not None else node.get("first")
    last = edges if edges is not None else node.get("last")
    span = lambda s: (s["layers"], s["bits"]) if s is not None else (0, None)  # noqa: E731
    return LayerProfile("spans", base=node["base"], first=span(first), last=span(last),
                        spec=_plain(node))


def _plain(node):
    return {k: dict(v) if isinstance(v, dict) else v for k, v in node.items()}


def resolve_params(params: dict, n_layers: int) -> dict:
    """params with every LayerProfile resolved for n_layers (others unchanged)."""
    return {k: v.resolve(n_layers) if isinstance(v, LayerProfile) else v for k, v in params.items()}


def has_profile(params: dict) -> bool:
    return any(isinstance(v, LayerProfile) for v in params.values())


def compact_layers(values) -> str:
    """A per-layer list, short: runs of 3 or more equal entries as [v]*n, joined with +.
    (4, 4, 2 x 28, 4, 4) -> "[4, 4] + [2]*28 + [4, 4]" (a valid Python expression)."""
    values = list(values)
    runs = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        runs.append((values[i], j - i))
        i = j
    pieces = []
    literal: list = []
    for value, count in runs:
        if count >= 3:
            if literal:
                pieces.append("[" + ", ".join(map(str, literal)) + "]")
                literal = []
            pieces.append(f"[{value}]*{count}")
        else:
            literal.extend([value] * count)
    if literal:
        pieces.append("[" + ", ".join(map(str, literal)) + "]")
    return " + ".join(pieces) if pieces else "[]"


def show_value(value) -> str:
    """A parameter value for text output: per-layer lists compact, others as str()."""
    if isinstance(value, (list, tuple)):
        return compact_layers(value)
    if isinstance(value, LayerProfile):
        return value.describe()
    return str(value)


def json_safe(value):
    """A parameter value for JSON: tuples as lists, profiles as the spec written in YAML."""
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, LayerProfile):
        return value.spec
    return value


def json_text(data) -> str:
    """JSON like json.dumps(indent=2), except that a list of numbers stays on one line: a
    per-layer list of 80 entries is one line, not 80 (the CLI's --json output)."""
    import json

    def render(node, indent: int) -> str:
        pad = "  " * (indent + 1)
        if isinstance(node, dict):
            if not node:
                return "{}"
            items = [f"{pad}{json.dumps(str(k))}: {render(v, indent + 1)}" for k, v in node.items()]
            return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
        if isinstance(node, (list, tuple)):
            if not node:
                return "[]"
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in node):
                return "[" + ", ".join(json.dumps(v) for v in node) + "]"
            items = [f"{pad}{render(v, indent + 1)}" for v in node]
            return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
        return json.dumps(node)

    return render(data, 0)
