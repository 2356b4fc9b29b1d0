"""Syrupy snapshots of every policy version's decisions over a fixed grid of workloads:
config, reason and trail. Any change in a decision shows up as a reviewed snapshot diff
(`pytest --snapshot-update` rewrites tests/policy/__snapshots__/)."""

import pytest

from veloxquant_mlx import HardwareInfo, WorkloadSpec, select_kv_cache_config
from veloxquant_mlx.policy.sources import default_policy_path, load_policy
from veloxquant_mlx.policy.versions import VERSIONS

GIB = 2**30
HEAD_DIMS = (64, 128, 256, 512)
SEQ_LENS = (1, 2047, 2048, 16383, 16384, 64_000)
MEMORY = ("unknown", "roomy", "exactly-0.75", "over")


def _hardware(kind: str, fp16: int) -> HardwareInfo:
    return {
        "unknown": HardwareInfo(),
        "roomy": HardwareInfo(64 * GIB, 4 * GIB) if fp16 < 32 * GIB else HardwareInfo(1024 * GIB, 0),
        "exactly-0.75": HardwareInfo(4 * fp16, 2 * fp16),
        "over": HardwareInfo(fp16, 0),
    }[kind]


def _grid_decisions(policy) -> list:
    out = []
    for head_dim in HEAD_DIMS:
        for seq_len in SEQ_LENS:
            workload = WorkloadSpec(head_dim=head_dim, seq_len=seq_len, n_layers=32, batch_size=4)
            for memory in MEMORY:
                result = select_kv_cache_config(workload, _hardware(memory, workload.fp16_kv_bytes()),
                                                policy=policy)
                trail = result.decision.to_dict()
                trail["policy"].pop("sha256")  # the file's bytes: comments would churn snapshots
                trail["policy"].pop("source")  # a machine path
                out.append({"workload": f"head_dim={head_dim} seq_len={seq_len} memory={memory}",
                            "config": result.config.to_dict(), "reason": result.reason,
                            "rules": trail["rules"], "adjustments": trail["adjustments"]})
    return out


@pytest.mark.parametrize("version", list(VERSIONS))
def test_decisions_per_version(version, snapshot):
    policy = load_policy(default_policy_path(version))
    assert _grid_decisions(policy) == snapshot(name=f"policy_v{version}")
