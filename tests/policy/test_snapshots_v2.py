"""Syrupy snapshots of the packaged v2 policy over the same fixed grid of workloads as v1
(test_snapshots.py): config, reason and trail. v2's snapshots live in their own file, so v1's
never change because of v2. A second snapshot shows the per-layer resolution over depths."""

from veloxquant_mlx import HardwareInfo, WorkloadSpec, select_kv_cache_config
from veloxquant_mlx.policy.sources import default_policy_path, load_policy
from tests.policy.test_snapshots import _grid_decisions


def test_decisions_v2(snapshot):
    policy = load_policy(default_policy_path(2))
    assert policy.version == 2
    assert _grid_decisions(policy) == snapshot(name="policy_v2")


def test_per_layer_resolution_v2(snapshot):
    policy = load_policy(default_policy_path(2))
    out = {}
    for n_layers in (1, 2, 3, 4, 5, 6, 32):
        for seq_len in (100, 4096, 20_000):
            result = select_kv_cache_config(WorkloadSpec(128, seq_len, n_layers, 1), HardwareInfo(),
                                            policy=policy)
            out[f"n_layers={n_layers} seq_len={seq_len}"] = result.config.to_dict()
    assert out == snapshot(name="policy_v2_layers")
