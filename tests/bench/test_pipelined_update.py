"""bench.pipelined_update runs both orders of mlx-lm KVCache steps and writes its figures (the
timing itself is a measurement, not asserted here: results/pipelined_update_cpu.json)."""

import json

from veloxquant_mlx.bench import pipelined_update


def test_both_orders_run_and_are_written(tmp_path):
    out = tmp_path / "p.json"
    assert pipelined_update.main(["--context", "300", "--steps", "3", "--no-openblas", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["settings"]["buffers_bytes"] == 2 * 300 * 8 * 128 * 2
    for mode in ("sync", "pipelined"):
        row = result["results"][mode]
        assert len(row["step_ms"]) == 3 and all(t > 0 for t in row["step_ms"])
        assert row["median_ms"] <= row["max_ms"]
