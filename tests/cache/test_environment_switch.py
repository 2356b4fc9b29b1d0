"""environment_switch.value reads what os.environ.get reads, at every call: set, unset, changed
while the process runs (by os.environ, monkeypatch or mock.patch.dict), and where os.environ
has been replaced by a mapping that is not CPython's (its plain get is used)."""

import os
from unittest import mock

from veloxquant_mlx.cache import environment_switch, fused_decode

NAME = "VELOXQUANT_TEST_SWITCH"


def test_value_follows_every_change_of_the_environment(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert environment_switch.value(NAME) is None
    assert environment_switch.value(NAME, "1") == "1"
    monkeypatch.setenv(NAME, "0")
    assert environment_switch.value(NAME, "1") == "0"
    os.environ[NAME] = "ünïcode"  # a value that takes the environment's encoding
    assert environment_switch.value(NAME) == "ünïcode" == os.environ.get(NAME)
    with mock.patch.dict(os.environ, {NAME: "2"}):
        assert environment_switch.value(NAME) == "2"
    assert environment_switch.value(NAME) == "ünïcode"
    del os.environ[NAME]
    assert environment_switch.value(NAME, "default") == "default"


def test_a_replaced_environ_is_read_through_its_own_get(monkeypatch):
    monkeypatch.setenv(NAME, "real")
    monkeypatch.setattr(os, "environ", {NAME: "replaced"})
    assert environment_switch.value(NAME) == "replaced"
    assert environment_switch.value("VELOXQUANT_TEST_ABSENT", "d") == "d"
    monkeypatch.undo()  # os.environ back: read through it again
    assert environment_switch.value(NAME) == os.environ.get(NAME)


def test_the_kernels_switch_takes_effect_at_the_next_call(monkeypatch):
    monkeypatch.setattr(fused_decode, "_cuda_available", lambda: True)
    monkeypatch.setattr(fused_decode.mx, "default_device", lambda: fused_decode.mx.Device(fused_decode.mx.gpu, 0))
    monkeypatch.delenv(fused_decode.ENV_SWITCH, raising=False)
    assert fused_decode.kernels_enabled()
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    assert not fused_decode.kernels_enabled()
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    assert fused_decode.kernels_enabled()
