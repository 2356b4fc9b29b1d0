"""bench/chunk_census.py: one layer's prefill chunk on CUDA's path, counted on the CPU."""

import json
import subprocess
import sys

import pytest

from veloxquant_mlx.bench import chunk_census


def test_census_command_end_to_end(tmp_path):
    """A small history and chunk: fp16's chunk is mlx-lm's (its cache's writes and the composed
    attention, no kernel of ours), turboquant_rvq's builds its prefill kernel once, and its
    store growth with slack needs no zero fill unless base.SLACK_FROM_WRITE is 0 (one per store
    array then). In a subprocess: the census leaves mx.compile traces made under its stand-ins."""
    out = tmp_path / "chunk.json"
    done = subprocess.run(
        [sys.executable, "-m", "veloxquant_mlx.bench.chunk_census", "--methods", "fp16,turboquant_rvq",
         "--history", "256", "--chunk", "512", "--alternate", "base.SLACK_FROM_WRITE=0", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["methods"]
    assert list(rows) == ["fp16", "fp16@base.SLACK_FROM_WRITE=0", "turboquant_rvq",
                          "turboquant_rvq@base.SLACK_FROM_WRITE=0"]
    assert not any(name.startswith("CustomKernel") for name in rows["fp16"]["by_primitive"])
    assert rows["fp16"]["by_primitive"] == rows["fp16@base.SLACK_FROM_WRITE=0"]["by_primitive"]
    ours, zeros = rows["turboquant_rvq"], rows["turboquant_rvq@base.SLACK_FROM_WRITE=0"]
    assert ours["by_primitive"]["CustomKernel:vq_rvq_prefill_kv"] == 1
    assert ours["by_primitive"].get("Full", 0) == 0 and zeros["by_primitive"]["Full"] == 10  # 10 store arrays
    assert zeros["launches"] - ours["launches"] == 10
    assert "turboquant_rvq@base.SLACK_FROM_WRITE=0" in done.stdout


def test_unknown_method_and_bad_constant_are_refused(tmp_path):
    out = str(tmp_path / "x.json")
    with pytest.raises(SystemExit):
        chunk_census.parse_args(["--methods", "fp16,nope", "--out", out])
    with pytest.raises(SystemExit):
        chunk_census.parse_args(["--alternate", "base.NO_SUCH=1", "--out", out])
