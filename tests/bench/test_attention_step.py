"""The one-layer decode-attention timer runs end to end on a tiny shape and records each method."""

import json

from veloxquant_mlx.bench import attention_step


def test_tiny_run_writes_a_case_per_method(tmp_path):
    out = tmp_path / "step.json"
    attention_step.main(["--out", str(out), "--contexts", "320", "--methods", "kivi,xquant",
                         "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--warmup", "1",
                         "--calls", "2", "--dtype", "float32"])
    data = json.loads(out.read_text())
    cases = {(c["spec"], c.get("mode")) for c in data["cases"]}
    assert {("fp16-sdpa", None), ("kivi", "portable"), ("xquant", "portable")} <= cases
    for case in data["cases"]:
        assert case["median_ms"] > 0 and case["n"] == 2
