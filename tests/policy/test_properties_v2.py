"""Hypothesis on the packaged v2 policy: every valid workload, of any depth, gets a decision
whose method is the seed rules' and whose per-layer list has one entry per attention layer
(or, past MAX_RESOLVED_LAYERS, the profile's base); plus v2's schema agrees with the registries."""

import json

from hypothesis import given, settings, strategies as st

from veloxquant_mlx import WorkloadSpec, select_kv_cache_config
from veloxquant_mlx.config.fields import FIELDS, METHODS
from veloxquant_mlx.policy.facts import FACT_NAMES
from veloxquant_mlx.policy.layers import MAX_RESOLVED_LAYERS
from veloxquant_mlx.policy.resources import resource_path
from veloxquant_mlx.policy.sources import default_policy_path, load_policy
from veloxquant_mlx.policy.versions import VERSIONS
from tests.policy.test_properties import _expected, hardware

workloads = st.builds(
    WorkloadSpec,
    head_dim=st.integers(0, 12).map(lambda e: 2**e),
    seq_len=st.integers(1, 10**7),
    n_layers=st.one_of(st.integers(1, 8), st.integers(1, 256), st.integers(4000, 5000),
                       st.integers(1, 10**12)),
    batch_size=st.integers(1, 512),
)


@settings(max_examples=300, deadline=None)
@given(workloads, hardware)
def test_v2_decides_every_workload_at_every_depth(workload, hw):
    policy = load_policy(default_policy_path(2))
    config = select_kv_cache_config(workload, hw, policy=policy).config
    method, _ = _expected(workload, hw)
    assert config.method == method
    bits = config.bit_width_inlier
    if method in ("turboquant_rvq", "kivi"):
        assert config.key_bits == 4
        base = 3 if method == "turboquant_rvq" else 2
        if workload.n_layers > MAX_RESOLVED_LAYERS:
            assert bits == base
        else:
            n = workload.n_layers
            assert len(bits) == n
            assert all(b == (4 if i < 2 or i >= n - 2 else base) for i, b in enumerate(bits))
            assert config.bits_for_layer(n - 1, n) == 4


def test_v2_schema_enums_match_registries():
    schema = json.loads(resource_path("schemas", VERSIONS[2].schema_file).read_text())
    defs = schema["$defs"]
    select = defs["rule"]["properties"]["select"]["properties"]
    assert select["method"]["enum"] == list(METHODS)
    assert select["params"]["propertyNames"]["enum"] == list(FIELDS)
    # Exactly the per-layer fields of the registry may take a layer profile.
    assert list(select["params"]["properties"]) == [n for n, s in FIELDS.items() if s.per_layer]
    assert defs["condition"]["properties"]["fact"]["enum"] == list(FACT_NAMES)
    assert defs["adjustment"]["properties"]["set"]["propertyNames"]["enum"] == list(METHODS)
