"""The committed schemas agree with the code's registries, and every version is loadable."""

import json

import jsonschema
import pytest

from veloxquant_mlx.config.fields import FIELDS, METHODS
from veloxquant_mlx.policy.facts import FACT_NAMES
from veloxquant_mlx.policy.resources import resource_path
from veloxquant_mlx.policy.sources import default_policy_path, load_policy
from veloxquant_mlx.policy.versions import VERSIONS


@pytest.mark.parametrize("version", list(VERSIONS))
def test_schema_is_valid_2020_12(version):
    schema = json.loads(resource_path("schemas", VERSIONS[version].schema_file).read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_v1_enums_match_registries():
    schema = json.loads(resource_path("schemas", VERSIONS[1].schema_file).read_text())
    defs = schema["$defs"]
    assert defs["rule"]["properties"]["select"]["properties"]["method"]["enum"] == list(METHODS)
    assert defs["rule"]["properties"]["select"]["properties"]["params"]["propertyNames"]["enum"] == list(FIELDS)
    assert defs["condition"]["properties"]["fact"]["enum"] == list(FACT_NAMES)
    assert defs["adjustment"]["properties"]["set"]["propertyNames"]["enum"] == list(METHODS)


@pytest.mark.parametrize("version", list(VERSIONS))
def test_each_version_has_a_loadable_packaged_policy(version):
    policy = load_policy(default_policy_path(version))
    assert policy.version == version
