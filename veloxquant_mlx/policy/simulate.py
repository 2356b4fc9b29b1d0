"""Simulate: the decision in every band of seq_len x pressure_fraction x head_dim, as a table.

Bands are cut at the policy's own thresholds, so each row and column is a region where the
decision cannot change (for the facts shown; other facts take the witness's values, listed).
"""

from __future__ import annotations

from veloxquant_mlx.policy.bands import bands_of, cells, describe_range, witness
from veloxquant_mlx.policy.compiler import CompiledPolicy
from veloxquant_mlx.policy.evaluator import choose

AXES = ("seq_len", "head_dim", "pressure_fraction")


def simulate_policy(policy: CompiledPolicy) -> dict:
    thresholds = policy.thresholds()
    dims = {name: bands_of(name, thresholds.get(name, ())) for name in AXES}
    rows = []
    for index, cell in cells(dims):
        found = witness(cell)
        labels = {name: describe_range(name, dims[name], i, i) or "any"
                  for name, i in zip(AXES, index)}
        if found is None:
            rows.append({**labels, "decision": None, "rule": None, "adjustments": [], "witness": None})
            continue
        _, _, facts = found
        chosen = choose(policy, facts)
        if chosen is None:
            rows.append({**labels, "decision": "GAP", "rule": None, "adjustments": [], "witness": facts})
            continue
        rule, applied = chosen
        config = policy.config_for(rule.index, applied)
        rows.append({**labels, "decision": config.to_dict(), "rule": rule.id,
                     "adjustments": [policy.adjustments[i].id for i in applied], "witness": facts})
    return {"policy": f"{policy.name} v{policy.version}", "axes": list(AXES), "rows": rows}


def _short(row) -> str:
    if row["decision"] is None:
        return "(no workload)"
    if row["decision"] == "GAP":
        return "GAP"
    text = f"{row['decision']['method']} ({row['rule']}"
    if row["adjustments"]:
        text += "+" + "+".join(row["adjustments"])
    return text + ")"


def format_table(result: dict) -> str:
    rows = result["rows"]
    columns = list(dict.fromkeys(row["pressure_fraction"] for row in rows))
    lines_by_key: dict = {}
    for row in rows:
        key = (row["seq_len"], row["head_dim"])
        lines_by_key.setdefault(key, {})[row["pressure_fraction"]] = _short(row)
    header = ["seq_len", "head_dim", *columns]
    table = [header] + [[k[0], k[1], *(cols.get(c, "") for c in columns)]
                        for k, cols in lines_by_key.items()]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    out = [f"simulate {result['policy']}: method (rule+adjustments) per band"]
    for n, line in enumerate(table):
        out.append("  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * width for width in widths))
    return "\n".join(out)
