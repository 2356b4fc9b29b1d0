"""Every kind of bad policy input of issue 2 gets a clear PolicyError, fast, naming
file:line:column and the node's path, and nothing in it is executed."""

import time

import pytest

from veloxquant_mlx import PolicyError
from veloxquant_mlx.policy import compile_policy_text
from veloxquant_mlx.policy.loader import MAX_ALIASES, MAX_BYTES, MAX_DEPTH
from tests.policy.helpers import DEFAULT_TEXT, edited


def _alias_bomb(levels: int = 40) -> str:
    """The billion-laughs shape: each level lists the previous one nine times."""
    lines = ["l0: &l0 [x, x]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


BOMB = _alias_bomb()

CASES = {
    "malformed yaml": (edited("rules:", "rules: [\n"), r"x\.yaml:\d+:\d+: malformed YAML"),
    "wrong type": (edited("gte: 0.75", 'gte: "high"'), r"x\.yaml:15:\d+: rules\[0\]\.when\.gte: \"high\" is not of type 'number'"),
    "bool is not a number": (edited("gear_bits: 2", "gear_bits: true"), r"rules\[0\]\.select\.params\.gear_bits: true is invalid"),
    "unknown fact": (edited("fact: head_dim", "fact: head_dims"), r"adjustments\[0\]\.when\.fact: 'head_dims' is unknown: allowed is one of \('head_dim'"),
    "unknown operator": (edited("gte: 256", "geq: 256"), r"adjustments\[0\]\.when\.geq: unknown key 'geq': allowed are fact, lt, lte"),
    "unknown method": (edited("method: kivi", "method: kiwi"), r"rules\[2\]\.select\.method: 'kiwi' is unknown"),
    "unknown parameter": (edited("params: {gear_bits: 2}", "params: {gear_bitz: 2}"), r"rules\[0\]\.select\.params\.gear_bitz: 'gear_bitz' is not a parameter of gear: allowed are gear_bits"),
    "parameter of another method": (edited("params: {gear_bits: 2}", "params: {gear_bits: 2, kivi_group_size: 64}"), r"rules\[0\]\.select\.params\.kivi_group_size: does not apply to method gear: it belongs to kivi"),
    "out-of-range parameter": (edited("params: {bit_width_inlier: 2}", "params: {bit_width_inlier: 2, kivi_group_size: 48}"),
                               r"^policies/x\.yaml:32:54: rules\[2\]\.select\.params\.kivi_group_size: 48 is invalid for kivi: allowed is one of \(32, 64, 128\)$"),
    "out-of-range fraction": (edited("kvquant_outlier_fraction: 0.01", "kvquant_outlier_fraction: 0.5"), r"kvquant_outlier_fraction: 0\.5 is invalid for kvquant: allowed is a number from 0 to 0\.1"),
    "out-of-range adjustment": (edited("gear: {gear_group_size: 64}", "gear: {gear_group_size: 65}"), r"adjustments\[0\]\.set\.gear\.gear_group_size: 65 is invalid for gear"),
    "duplicate ids": (edited("id: long-context", "id: short-context"), r"rules\[3\]\.id: 'short-context' is a duplicate id: already used by rules\[1\] \(policies/x\.yaml:21:9\)"),
    "duplicate id across adjustments": (edited("id: wide-heads", "id: short-context"), r"adjustments\[0\]\.id: 'short-context' is a duplicate id"),
    "duplicate yaml key": (edited("name: default", "name: default\nname: other"), r"duplicate key 'name'"),
    "unknown version": (edited("policy_version: 1", "policy_version: 2"), r"x\.yaml:7:17: policy_version: 2 is unknown: allowed is one of \(1,\)"),
    "missing version": (edited("policy_version: 1", "policy_versio: 1"), r"policy_version is missing"),
    "python tag": (edited("name: default", 'name: !!python/object/apply:os.system ["touch /tmp/vq_pwned"]'), r"x\.yaml:8:7: YAML tag 'tag:yaml\.org,2002:python/object/apply:os\.system' is not allowed"),
    "python name tag": (edited("name: default", "name: !!python/name:os.system"), r"YAML tag .*python/name:os\.system' is not allowed"),
    "custom tag": (edited("name: default", "name: !foo bar"), r"YAML tag '!foo' is not allowed"),
    "merge key": (edited("  - id: short-context\n", "  - <<: {id: x}\n    id: short-context\n"), r"merge keys"),
    "alias bomb": (BOMB, rf"more than {MAX_ALIASES} uses of YAML aliases"),
    "oversized": ("name: '" + "a" * (MAX_BYTES + 10) + "'\n", rf"too large: allowed is at most {MAX_BYTES} bytes"),
    "deeply nested": ("policy_version: 1\nname: x\nrules: " + "[" * 5000 + "]" * 5000, rf"nesting deeper than {MAX_DEPTH} levels"),
    "deep conditions": (edited("when: {fact: head_dim, gte: 256}", "when: " + "{not: " * 40 + "{fact: head_dim, gte: 256}" + "}" * 40), rf"nesting deeper than {MAX_DEPTH}"),
    "template attribute access": (edited("{seq_len} < 2048", "{seq_len.__class__} < 2048"), r"rules\[1\]\.reason: .* attribute access and indexing are not allowed"),
    "template indexing": (edited("{seq_len} < 2048", "{seq_len[0]} < 2048"), r"attribute access and indexing are not allowed"),
    "template positional": (edited("{seq_len} < 2048", "{0} < 2048"), r"positional holes"),
    "template unknown fact": (edited("{seq_len} < 2048", "{secret} < 2048"), r"\{secret\}: unknown fact"),
    "template conversion": (edited("{seq_len} < 2048", "{seq_len!r} < 2048"), r"conversions are not allowed"),
    "template huge width": (edited("{seq_len} < 2048", "{seq_len:999999999}"), r"format spec '999999999' is not allowed"),
    "template nested spec": (edited("{seq_len} < 2048", "{seq_len:{head_dim}}"), r"is not allowed"),
    "template bad spec for float": (edited("{pressure_fraction:.1%}", "{pressure_fraction:d}"), r"does not fit a float fact"),
    "template unbalanced": (edited("{seq_len} < 2048", "{seq_len < 2048"), r"malformed template"),
    "non-finite number": (edited("gte: 0.75", "gte: .inf"), r"numbers must be finite"),
    "empty document": ("", r"the document is empty"),
    "not a mapping": ("- 1\n- 2\n", r"a policy is a mapping"),
    "two documents": (DEFAULT_TEXT + "\n---\nname: x\n", r"malformed YAML"),
    "comparison without operator": (edited("when: {fact: head_dim, gte: 256}", "when: {fact: head_dim}"), r"a comparison is \{fact: NAME, OP: NUMBER"),
    "mixed condition": (edited("when: {fact: head_dim, gte: 256}", "when: {all: [{fact: head_dim, gte: 256}], not: {fact: seq_len, lt: 2}}"), r"exactly one of all"),
    "unknown top-level key": (edited("name: default", "name: default\nrulez: []"), r"rulez: unknown key 'rulez'"),
    "missing reason": (edited('    reason: "seq_len {seq_len} < 2048"\n', ""), r"rules\[1\]: 'reason' is missing"),
    "huge integer": (edited("gte: 0.75", "gte: " + "9" * 5000), r"x\.yaml:15:\d+"),
    "not utf-8": (b"name: \xff\xfe", r"not UTF-8"),
    "bad id": (edited("id: wide-heads", "id: Wide Heads!"), r"adjustments\[0\]\.id: .* is invalid: an id is"),
    "too many rules": (edited("rules:\n", "rules:\n" + "".join(
        f"  - {{id: r{i}, select: {{method: kivi}}, reason: r}}\n" for i in range(300))),
        r"^policies/x\.yaml:\d+:\d+: rules: \[.{0,60} is invalid: allowed is at most 256 items$"),
    "empty rules": (edited(DEFAULT_TEXT[DEFAULT_TEXT.index("rules:"):DEFAULT_TEXT.index("adjustments:")], "rules: []\n"), r"rules: \[\] is invalid: allowed is at least 1 item"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_a_clear_policy_error(name, tmp_path):
    text, pattern = CASES[name]
    start = time.perf_counter()
    with pytest.raises(PolicyError, match=pattern) as info:
        compile_policy_text(text, "policies/x.yaml")
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"{name}: {elapsed * 1e3:.0f} ms"  # milliseconds on an idle machine
    message = str(info.value)
    assert message.startswith("policies/x.yaml"), message
    assert "Traceback" not in message


def test_nothing_is_executed(tmp_path):
    marker = tmp_path / "pwned"
    text = edited("name: default", f'name: !!python/object/apply:os.system ["touch {marker}"]')
    with pytest.raises(PolicyError):
        compile_policy_text(text, "x.yaml")
    assert not marker.exists()


def test_every_schema_error_is_listed():
    text = edited("name: default", "name: default\nrulez: []").replace("gte: 0.75", 'gte: "x"')
    with pytest.raises(PolicyError) as info:
        compile_policy_text(text, "x.yaml")
    assert "rulez" in str(info.value) and "rules[0].when.gte: \"x\" is not of type" in str(info.value)


def test_valid_edits_compile():
    policy = compile_policy_text(edited("params: {gear_bits: 2}", "params: {gear_bits: 4, gear_rank: 0}"), "x.yaml")
    assert policy.rules[0].params == {"gear_bits": 4, "gear_rank": 0}
    per_layer = edited("params: {bit_width_inlier: 4}", "params: {bit_width_inlier: [4, 3, 2]}")
    assert compile_policy_text(per_layer, "x.yaml").rules[1].params["bit_width_inlier"] == (4, 3, 2)
    with pytest.raises(PolicyError, match=r"bit_width_inlier\[1\]: 7 is invalid for turboquant_rvq: allowed is 1\.\.4"):
        compile_policy_text(edited("params: {bit_width_inlier: 4}", "params: {bit_width_inlier: [4, 7]}"), "x.yaml")
