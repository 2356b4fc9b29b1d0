"""Stage 2: pick the schema of the policy_version a document names, and validate against it.

Adding a policy version is a new YAML in policies/, a new schema in schemas/ and one entry in
VERSIONS (with the compiler for that shape; a shape-compatible version reuses compile_v1).
Unknown versions are refused, never read with another version's rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

from veloxquant_mlx.errors import PolicyError
from veloxquant_mlx.policy.loader import LoadedDocument, format_path
from veloxquant_mlx.policy.resources import resource_path


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    schema_file: str  # in schemas/
    default_policy_file: str  # in policies/: the packaged policy of this version
    compiler: str  # name of the compile function in veloxquant_mlx.policy.compiler


VERSIONS: dict[int, PolicyVersion] = {
    1: PolicyVersion(1, "kv_cache_policy.v1.schema.json", "kv_cache_policy.v1.yaml", "compile_v1"),
}
DEFAULT_VERSION = 1


def version_of(doc: LoadedDocument) -> PolicyVersion:
    data = doc.data
    if not isinstance(data, dict):
        raise PolicyError(f"{doc.where(())}: <root>: a policy is a mapping with policy_version, "
                          f"name and rules, got {type(data).__name__}")
    if "policy_version" not in data:
        raise PolicyError(f"{doc.where(())}: <root>: policy_version is missing: allowed is one of "
                          f"{tuple(VERSIONS)}")
    version = data["policy_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version not in VERSIONS:
        raise PolicyError(f"{doc.where(('policy_version',))}: policy_version: {version!r} is unknown: "
                          f"allowed is one of {tuple(VERSIONS)}")
    return VERSIONS[version]


@lru_cache(maxsize=None)
def schema_validator(version: int):
    # Imported here: jsonschema takes 0.2-0.4 s to import on this machine, and `import
    # veloxquant_mlx` should not pay that unless a policy file is actually compiled.
    import jsonschema

    entry = VERSIONS[version]
    path = resource_path("schemas", entry.schema_file)
    schema = json.loads(path.read_text(encoding="utf-8"))
    # The schema's own validity against the 2020-12 metaschema is a test
    # (tests/policy/test_schema_consistency.py), not a cost paid at every cold start.
    return jsonschema.Draft202012Validator(schema)


def _message(error, doc: LoadedDocument) -> str:
    """A reviewer-friendly sentence for one jsonschema error."""
    custom = error.schema.get("x-error") if isinstance(error.schema, dict) else None
    path = tuple(error.absolute_path)
    if _is_key_error(error) and path:
        method = _method_at(doc.data, path)
        if method is not None:
            from veloxquant_mlx.config.fields import fields_of

            return (f"{error.instance!r} is not a parameter of {method}: allowed are "
                    f"{', '.join(fields_of(method))}")
    if _is_key_error(error):
        return f"unknown key {error.instance!r}: allowed are {', '.join(error.validator_value)}"
    if error.validator == "additionalProperties" and error.validator_value is False:
        allowed = list(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        return f"unknown key {extra[0]!r}: allowed are {', '.join(allowed)}"
    if error.validator == "enum":
        return f"{_short_repr(error.instance)} is unknown: allowed is one of {tuple(error.validator_value)}"
    if error.validator == "const":
        return f"{_short_repr(error.instance)} is invalid: allowed is {error.validator_value!r}"
    if error.validator == "required":
        return error.message.replace("is a required property", "is missing (required)")
    if custom:
        return f"{_short(error.instance)} is invalid: {custom}"
    bounds = {
        "maxItems": "at most {} items", "minItems": "at least {} item(s)",
        "maxLength": "at most {} characters", "minLength": "at least {} character(s)",
        "maxProperties": "at most {} keys", "minProperties": "at least {} key(s)",
    }
    if error.validator in bounds:
        return f"{_short(error.instance)} is invalid: allowed is {bounds[error.validator].format(error.validator_value)}"
    if error.validator == "type":
        return f"{_short(error.instance)} is not of type {error.validator_value!r}"
    if error.validator == "pattern":
        return f"{_short(error.instance)} is invalid: allowed is text matching {error.validator_value}"
    # Any other validator: jsonschema's message, never the whole (possibly huge) instance.
    message = error.message
    return message if len(message) <= 200 else message[:197] + "..."


def _is_key_error(error) -> bool:
    """An error raised by propertyNames: the instance is a mapping key, not a value."""
    schema_path = list(error.absolute_schema_path)
    return (len(schema_path) >= 2 and schema_path[-2] == "propertyNames"
            and error.validator == "enum" and isinstance(error.instance, str))


def _method_at(data, path: tuple):
    """The method a params mapping at path belongs to (select.params or set.METHOD), if any."""
    if len(path) >= 2 and path[-1] == "params" and path[-2] == "select":
        node = data
        for part in path[:-1]:
            node = node[part]
        method = node.get("method") if isinstance(node, dict) else None
        return method if isinstance(method, str) and method in _methods() else None
    if len(path) >= 2 and path[-2] == "set" and path[-1] in _methods():
        return path[-1]
    return None


def _methods():
    from veloxquant_mlx.config.fields import METHODS

    return METHODS


def _short_repr(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _error_location(error, doc: LoadedDocument) -> tuple[str, tuple]:
    path = tuple(error.absolute_path)
    # An unknown key is reported at the key itself.
    if _is_key_error(error):
        return doc.where_key(path + (error.instance,)), path + (error.instance,)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - allowed)
        if extra:
            return doc.where_key(path + (extra[0],)), path + (extra[0],)
    return doc.where(path), path


def _leaf_errors(error):
    # oneOf/anyOf with an x-error text: one message for the group; otherwise report the
    # innermost concrete errors.
    if error.validator in ("oneOf", "anyOf") and isinstance(error.schema, dict) and "x-error" in error.schema:
        yield error
    elif error.context:
        for sub in error.context:
            yield from _leaf_errors(sub)
    else:
        yield error


def validate_schema(doc: LoadedDocument, version: PolicyVersion) -> None:
    """PolicyError listing every schema violation as file:line:column: path: message."""
    validator = schema_validator(version.version)
    errors = list(validator.iter_errors(doc.data))
    if not errors:
        return
    lines = []
    seen = set()  # one message per location: if/then branches can repeat the same complaint
    for error in sorted(errors, key=lambda e: [str(p) for p in e.absolute_path]):
        for leaf in _leaf_errors(error):
            where, path = _error_location(leaf, doc)
            if (where, path) in seen:
                continue
            seen.add((where, path))
            lines.append(f"{where}: {format_path(path)}: {_message(leaf, doc)}")
    raise PolicyError("\n".join(lines[:20]) + (f"\n... and {len(lines) - 20} more" if len(lines) > 20 else ""))
