"""Where a policy comes from, and the cache of compiled policies.

resolve_policy(policy):
  - a CompiledPolicy: used as is;
  - a path (str or os.PathLike): that file;
  - None: the file named by VELOXQUANT_POLICY when that variable is set and not empty, else the
    packaged default of the current version.
An invalid policy from any of these raises PolicyError; there is no silent fallback to the
default. Compiled policies are cached by resolved path and reused while the file's mtime and
size are unchanged; when they change the file is re-read, and recompiled only if its sha256
changed too (a `touch` costs one read, not a compile).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from veloxquant_mlx.errors import PolicyError
from veloxquant_mlx.policy.compiler import CompiledPolicy, compile_policy_text
from veloxquant_mlx.policy.loader import MAX_BYTES
from veloxquant_mlx.policy.resources import resource_path
from veloxquant_mlx.policy.versions import DEFAULT_VERSION, VERSIONS

ENV_VAR = "VELOXQUANT_POLICY"

_cache: dict = {}  # resolved path -> (mtime_ns, size, CompiledPolicy)
_lock = threading.Lock()


def default_policy_path(version: int = DEFAULT_VERSION) -> Path:
    return resource_path("policies", VERSIONS[version].default_policy_file)


def _read(path: Path, shown: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise PolicyError(f"{shown}: policy file not found") from None
    except IsADirectoryError:
        raise PolicyError(f"{shown}: is a directory, not a policy file") from None
    except OSError as exc:
        raise PolicyError(f"{shown}: cannot read the policy file: {exc.strerror}") from None
    if len(data) > MAX_BYTES:
        raise PolicyError(f"{shown}: larger than {MAX_BYTES} bytes: refused")
    return data


def load_policy(path: str | os.PathLike) -> CompiledPolicy:
    """The compiled policy in a file, from the cache when the file has not changed."""
    shown = os.fspath(path)
    try:
        resolved = Path(shown).resolve()
        stat = resolved.stat()
    except FileNotFoundError:
        raise PolicyError(f"{shown}: policy file not found") from None
    except OSError as exc:
        raise PolicyError(f"{shown}: cannot read the policy file: {exc.strerror}") from None
    with _lock:
        cached = _cache.get(resolved)
    if cached is not None and cached[0] == stat.st_mtime_ns and cached[1] == stat.st_size:
        return cached[2]
    data = _read(resolved, shown)
    if cached is not None and hashlib.sha256(data).hexdigest() == cached[2].sha256:
        policy = cached[2]
    else:
        policy = compile_policy_text(data, shown)
    with _lock:
        _cache[resolved] = (stat.st_mtime_ns, stat.st_size, policy)
    return policy


def resolve_policy(policy=None) -> CompiledPolicy:
    if isinstance(policy, CompiledPolicy):
        return policy
    if policy is None:
        env = os.environ.get(ENV_VAR)
        return load_policy(env if env else default_policy_path())
    if isinstance(policy, (str, os.PathLike)):
        return load_policy(policy)
    raise PolicyError(f"policy={policy!r} is invalid: allowed is None, a path (str or os.PathLike) "
                      "or a CompiledPolicy")


def clear_cache() -> None:
    with _lock:
        _cache.clear()
