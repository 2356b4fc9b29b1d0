"""Hypothesis: the default policy decides every valid workload on any machine, and the
decision agrees with the seed rules of the fixed API."""

from hypothesis import given, settings, strategies as st

from veloxquant_mlx import HardwareInfo, WorkloadSpec, select_kv_cache_config


workloads = st.builds(
    WorkloadSpec,
    head_dim=st.integers(0, 12).map(lambda e: 2**e),
    seq_len=st.integers(1, 10**7),
    n_layers=st.integers(1, 256),
    batch_size=st.integers(1, 512),
)
hardware = st.one_of(
    st.just(HardwareInfo()),
    st.builds(HardwareInfo, total_memory_bytes=st.one_of(st.none(), st.integers(0, 2**45)),
              active_memory_bytes=st.integers(0, 2**45)),
)


def _expected(workload: WorkloadSpec, hw: HardwareInfo):
    pressure = hw.pressure_fraction(workload.fp16_kv_bytes())
    if pressure is not None and pressure >= 0.75:
        method = "gear"
    elif workload.seq_len < 2048:
        method = "turboquant_rvq"
    elif workload.seq_len < 16384:
        method = "kivi"
    else:
        method = "kvquant"
    group = 64 if workload.head_dim >= 256 else 32
    return method, group


@settings(max_examples=300, deadline=None)
@given(workloads, hardware)
def test_every_valid_workload_is_decided_by_the_seed_rules(workload, hw):
    from veloxquant_mlx.policy.sources import default_policy_path

    result = select_kv_cache_config(workload, hw, policy=default_policy_path())
    method, group = _expected(workload, hw)
    config = result.config
    assert config.method == method
    assert "Policy default v1, rule " in result.reason
    group_field = {"kivi": "kivi_group_size", "kvquant": "kvquant_group_size", "gear": "gear_group_size"}
    if method in group_field:
        assert getattr(config, group_field[method]) == group
    else:
        assert config.to_dict() == {"method": "turboquant_rvq", "bit_width_inlier": 4, "key_bits": None,
                                    "value_bits": None, "seed": 0}
