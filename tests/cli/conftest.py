"""The CLI tests run against the packaged default policy, never one named by the environment."""

import pytest

from veloxquant_mlx.policy import sources


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(sources.ENV_VAR, raising=False)
