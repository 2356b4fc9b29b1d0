"""Diff: the regions of the fact space where two policies decide differently, as bands.

Both policies' thresholds are merged, so on every cell each policy's decision is constant;
cells whose final config differs (or that one policy leaves undecided) are merged into regions.
"""

from __future__ import annotations

from veloxquant_mlx.policy.bands import cells, describe_region, dims_of, merge_regions, witness, workload_flags
from veloxquant_mlx.policy.compiler import CompiledPolicy
from veloxquant_mlx.policy.evaluator import choose


def _outcome(policy: CompiledPolicy, facts: dict):
    chosen = choose(policy, facts)
    if chosen is None:
        return None, "no rule (gap)"
    rule, applied = chosen
    config = policy.config_for(rule.index, applied)
    params = ", ".join(f"{k}={v}" for k, v in config.to_dict().items() if k != "method" and v is not None)
    return config.to_dict(), f"{config.method}({params}) by {rule.id}"


def diff_policies(old: CompiledPolicy, new: CompiledPolicy) -> dict:
    thresholds = old.thresholds()
    for name, values in new.thresholds().items():
        thresholds.setdefault(name, set()).update(values)
    dims = dims_of(thresholds)
    changed = {}
    witnesses = {}
    for index, cell in cells(dims):
        found = witness(cell)
        if found is None:
            continue
        before, before_text = _outcome(old, found[2])
        after, after_text = _outcome(new, found[2])
        if before != after:
            changed[index] = (before_text, after_text)
            witnesses[index] = found
    regions = []
    for (before_text, after_text), ranges in merge_regions(changed):
        first = next(i for i in witnesses if changed[i] == (before_text, after_text)
                     and all(lo <= x <= hi for x, (lo, hi) in zip(i, ranges)))
        workload, hardware, _ = witnesses[first]
        regions.append({"region": describe_region(dims, ranges), "old": before_text,
                        "new": after_text, "witness": workload_flags(workload, hardware)})
    return {"old": f"{old.name} v{old.version} ({old.source})",
            "new": f"{new.name} v{new.version} ({new.source})", "changes": regions}


def format_diff(result: dict) -> str:
    lines = [f"diff {result['old']} -> {result['new']}"]
    if not result["changes"]:
        lines.append("no decision changes anywhere in the fact space")
    for change in result["changes"]:
        lines.append(f"where {change['region']}:")
        lines.append(f"    old: {change['old']}")
        lines.append(f"    new: {change['new']}")
        lines.append(f"    witness: {change['witness']}")
    return "\n".join(lines)
