"""The seed rules of the fixed API at every boundary, through the packaged default policy."""

import pytest

from veloxquant_mlx import HardwareInfo, WorkloadSpec, select_kv_cache_config
from tests.policy.helpers import GIB

UNKNOWN = HardwareInfo()


def choose(head_dim=128, seq_len=4096, n_layers=1, batch_size=1, hardware=UNKNOWN):
    return select_kv_cache_config(WorkloadSpec(head_dim, seq_len, n_layers, batch_size), hardware)


@pytest.mark.parametrize("seq_len, method", [
    (1, "turboquant_rvq"), (2047, "turboquant_rvq"), (2048, "kivi"), (16383, "kivi"),
    (16384, "kvquant"), (1_000_000, "kvquant"),
])
def test_length_bands(seq_len, method):
    result = choose(seq_len=seq_len)
    assert result.config.method == method
    assert "Policy default v1" in result.reason


def test_length_params():
    assert choose(seq_len=100).config.bit_width_inlier == 4
    assert choose(seq_len=4096).config.bit_width_inlier == 2
    long = choose(seq_len=20_000).config
    assert (long.kvquant_bits, long.kvquant_outlier_fraction) == (3, 0.01)


def _hardware_for_pressure(workload: WorkloadSpec, numerator: int, denominator: int) -> HardwareInfo:
    """A machine on which the workload's pressure is exactly numerator/denominator."""
    fp16 = workload.fp16_kv_bytes()
    total = fp16 * denominator
    return HardwareInfo(total_memory_bytes=total, active_memory_bytes=fp16 * numerator - fp16)


@pytest.mark.parametrize("seq_len", [100, 2047, 2048, 16384, 100_000])
def test_pressure_boundary_whatever_the_length(seq_len):
    workload = WorkloadSpec(128, seq_len, 4, 1)
    exactly = _hardware_for_pressure(workload, 3, 4)
    assert exactly.pressure_fraction(workload.fp16_kv_bytes()) == 0.75
    result = select_kv_cache_config(workload, exactly)
    assert result.config.method == "gear" and result.config.gear_bits == 2
    assert "rule memory-pressure" in result.reason
    fp16 = workload.fp16_kv_bytes()
    below = HardwareInfo(total_memory_bytes=fp16 * 4, active_memory_bytes=2 * fp16 - 1)
    assert below.pressure_fraction(fp16) < 0.75
    assert select_kv_cache_config(workload, below).config.method != "gear"


def test_unknown_memory_never_pressure():
    for total in (None, 0):
        result = choose(seq_len=100, hardware=HardwareInfo(total, 10**15))
        assert result.config.method == "turboquant_rvq"
        trace = result.decision.rules[0]
        assert trace.rule_id == "memory-pressure" and trace.matched is False
        assert trace.facts["pressure_fraction"] is None


@pytest.mark.parametrize("head_dim, group", [(128, 32), (256, 64), (512, 64)])
def test_wide_heads_group_size(head_dim, group):
    assert choose(head_dim=head_dim, seq_len=4096).config.kivi_group_size == group
    assert choose(head_dim=head_dim, seq_len=20_000).config.kvquant_group_size == group
    pressured = _hardware_for_pressure(WorkloadSpec(head_dim, 4096, 1, 1), 9, 10)
    assert choose(head_dim=head_dim, seq_len=4096, hardware=pressured).config.gear_group_size == group


@pytest.mark.parametrize("head_dim", [256, 512])
def test_turboquant_untouched_by_wide_heads(head_dim):
    result = choose(head_dim=head_dim, seq_len=100)
    assert result.config.to_dict() == {"method": "turboquant_rvq", "bit_width_inlier": 4,
                                       "key_bits": None, "value_bits": None, "seed": 0}
    adj = result.decision.adjustments[0]
    assert adj.adjustment_id == "wide-heads" and adj.matched and adj.applied == {}


def test_seed_example():
    result = select_kv_cache_config(WorkloadSpec(128, 64_000, 32, 4),
                                    HardwareInfo(total_memory_bytes=32 * GIB, active_memory_bytes=4 * GIB))
    assert result.config.method == "kvquant"
    assert result.reason == ("Policy default v1, rule long-context: seq_len 64000 >= 16384, so kvquant "
                             "with kvquant_bits=3, kvquant_outlier_fraction=0.01.")
    assert [t.rule_id for t in result.decision.rules] == [
        "memory-pressure", "short-context", "medium-context", "long-context"]
    assert [t.matched for t in result.decision.rules] == [False, False, False, True]
    assert result.decision.rules[0].facts["pressure_fraction"] == pytest.approx(0.2470703125)


def test_result_api():
    result = choose()
    config, reason = result.config, result.reason
    assert result == type(result)(config, reason)  # the trail does not take part in equality
    assert result.trail is result.decision
    assert result.decision.policy_sha256 and len(result.decision.policy_sha256) == 64
    with pytest.raises(AttributeError):
        result.reason = "x"


def test_hardware_none_detects(monkeypatch):
    import veloxquant_mlx.config.auto_config as auto

    monkeypatch.setattr(auto, "detect_hardware_info", lambda: HardwareInfo(1000, 10**12))
    assert select_kv_cache_config(WorkloadSpec(seq_len=100)).config.method == "gear"


def test_wrong_argument_types():
    from veloxquant_mlx import QuantizerConfigError

    with pytest.raises(QuantizerConfigError, match="WorkloadSpec"):
        select_kv_cache_config({"seq_len": 10})
    with pytest.raises(QuantizerConfigError, match="HardwareInfo"):
        select_kv_cache_config(WorkloadSpec(), 123)
