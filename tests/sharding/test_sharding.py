"""A tiny llama split across 2 processes (mlx-lm's tensor-parallel Model.shard, mx.distributed
ring backend on loopback, started by mlx.launch) generates with our caches the same greedy tokens
as one process."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from mlx_lm.generate import generate_step

from veloxquant_mlx import patch_model_kv_cache, unpatch_model_kv_cache
from tests.architectures.servable import config_for, servable_methods
from tests.sharding.reference import N_NEW, PROMPT, sharding_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH = os.path.join(os.path.dirname(sys.executable), "mlx.launch")


def _single_process(method):
    model = sharding_model()
    patch_model_kv_cache(model, config_for(method))
    try:
        ours = [int(t) for t, _ in generate_step(PROMPT, model, max_tokens=N_NEW)]
    finally:
        unpatch_model_kv_cache(model)
    fp16 = [int(t) for t, _ in generate_step(PROMPT, model, max_tokens=N_NEW)]
    return ours, fp16


@pytest.mark.slow  # two processes, ring start-up: ~40 s on the loaded 2-core machine
@pytest.mark.skipif(not os.path.exists(LAUNCH), reason="mlx.launch not installed")
@pytest.mark.parametrize("method", servable_methods())
def test_two_process_tensor_parallel_matches_one_process(method, tmp_path):
    out = tmp_path / "tokens.json"
    command = [shutil.which("mlx.launch") or LAUNCH, "-n", "2", "--backend", "ring", sys.executable,
               os.path.join(ROOT, "tests", "sharding", "shard_generate.py"), str(out), method]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    ours, fp16 = _single_process(method)
    assert result["world"] == 2
    for order in ("shard_then_patch", "patch_then_shard"):
        sharded = result[order]
        assert sharded["tokens"] == ours, order
        assert sharded["fp16"] == fp16, order  # the control: sharding itself is exact here
        # Per process: n_kv_heads / world_size = 1 KV head of head_dim 32 per layer, and the
        # prompt reached the compressed history.
        assert [c[:2] for c in sharded["caches"]] == [[1, 32], [1, 32]]
        assert all(c[2] > 0 for c in sharded["caches"])
