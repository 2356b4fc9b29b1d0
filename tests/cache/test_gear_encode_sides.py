"""gear_encoder.encode_sides: two sides' encodes run together, their outlier selections and power
iterations as paired launches (cache/paired_rows.py), each side's arrays those of its own
encode_side, bit for bit (on the CPU through the CUDA emulation, every encode kernel on; on CUDA
for real with `pytest -m cuda`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_encoder_identity import _bits
from veloxquant_mlx.cache import gear_encoder

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


def _sides(dim: int, blocks: int, seed: int, keys_count: int, values_count: int) -> list:
    """Keys (groups along tokens) and values (along channels) of 256-token blocks, bf16 side."""
    sides = []
    for i, (per_channel, count) in enumerate(((True, keys_count), (False, values_count))):
        x = mx.random.normal((1, 2, blocks, 256, dim), key=mx.random.key(seed + i)) * 2
        setting = gear_encoder.EncoderSetting(2, 32, 4, count, 256, mx.bfloat16, per_channel)
        sides.append((setting, x, None))
    return sides


def _encode(sides: list, together: bool) -> tuple[list[dict], set[str]]:
    with cuda_emulation.emulated_kernels() as made:
        out = gear_encoder.encode_sides(sides) if together else [gear_encoder.encode_side(*side) for side in sides]
        mx.eval(out)
    return out, {k.name.split("__")[0] for k in made}


def _assert_same(got: list[dict], want: list[dict]) -> None:
    for ours, theirs in zip(got, want):
        assert sorted(ours) == sorted(theirs)
        for name in theirs:
            assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
            assert np.array_equal(_bits(ours[name]), _bits(theirs[name])), name


def _together_as_alone(sides: list) -> tuple[set[str], set[str]]:
    """Both sides encoded together and each alone, emulated: the same arrays; the kernels each
    way launched (base names)."""
    together, made = _encode(sides, together=True)
    alone, made_alone = _encode(sides, together=False)
    _assert_same(together, alone)
    return made, made_alone


@needs_compiler
def test_both_sides_together_are_each_side_alone_bit_for_bit_with_paired_launches():
    made, made_alone = _together_as_alone(_sides(64, 2, seed=3, keys_count=164, values_count=164))
    assert {"vq_outlier_select_pair", "vq_gear_power_iteration_pair"} <= made
    assert not made & {"vq_outlier_select", "vq_gear_power_iteration"}
    assert not made_alone & {"vq_outlier_select_pair", "vq_gear_power_iteration_pair"}


@needs_compiler
def test_the_switch_launches_each_side_apart(monkeypatch):
    monkeypatch.setattr(gear_encoder, "PAIR_SIDES", False)
    made, _ = _together_as_alone(_sides(64, 1, seed=4, keys_count=100, values_count=100))
    assert {"vq_outlier_select", "vq_gear_power_iteration"} <= made
    assert not made & {"vq_outlier_select_pair", "vq_gear_power_iteration_pair"}


@needs_compiler
def test_sides_whose_selections_differ_select_apart_and_still_pair_the_power_iteration():
    """Another outlier count per side: two selections; the power iterations still pair."""
    made, _ = _together_as_alone(_sides(64, 1, seed=5, keys_count=100, values_count=60))
    assert "vq_outlier_select" in made and "vq_outlier_select_pair" not in made
    assert "vq_gear_power_iteration_pair" in made


def test_without_the_kernels_the_sides_encode_as_alone():
    """On the CPU (no kernel launches to pair) encode_sides is encode_side per side."""
    sides = _sides(64, 1, seed=7, keys_count=41, values_count=41)
    together = gear_encoder.encode_sides(sides)
    alone = [gear_encoder.encode_side(*side) for side in sides]
    _assert_same(together, alone)


@cuda_test
def test_both_sides_together_on_cuda_are_each_side_alone_bit_for_bit():
    sides = _sides(128, 8, seed=9, keys_count=328, values_count=328)
    together = gear_encoder.encode_sides(sides)
    alone = [gear_encoder.encode_side(*side) for side in sides]
    mx.eval(together, alone)
    _assert_same(together, alone)
