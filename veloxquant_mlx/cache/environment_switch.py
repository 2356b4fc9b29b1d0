"""An environment variable read at every call, without os.environ.get's exception.

Why: fused_decode.kernels_enabled reads VELOXQUANT_CUDA_KERNELS about twice per layer and decode
step (the window's in-place write, the attention's launch) and again where a flush encodes.
Where the variable is unset, the usual case, `os.environ.get` raises and catches a KeyError
inside (Mapping.get over os.environ's __getitem__): ~0.8 us on this machine's CPU against
~0.35 us where it is set, and ~0.15 us for the lookup here either way. On a host-bound H200
decode step of 32 layers that was ~50 us of a ~2 ms step. Read at each call, not once, so
a switch set while the process runs (bench.fused_check flips it between calls) takes effect at
the next step, as it did.

How: CPython's os.environ (os._Environ) holds its variables in `_data`, a dict keyed and valued
as its `encodekey` / `encodevalue` make them (bytes on POSIX, upper-cased str keys on Windows);
its `__setitem__` / `__delitem__` (and so monkeypatch.setenv, mock.patch.dict) update `_data`
together with the process's environment. Where os.environ is not such a mapping (replaced by a
plain dict, another interpreter), the lookup is os.environ.get.
"""

from __future__ import annotations

import os

# [the os.environ object bound, its `_data` (None: not an os._Environ), name -> encoded key,
# raw value -> its text]. Rebound when os.environ is another object than the one bound.
_BOUND: list = [None, None, {}, {}]


def value(name: str, default: str | None = None) -> str | None:
    """`name`'s value, as os.environ.get(name, default) gives it."""
    environ = os.environ
    if environ is not _BOUND[0]:
        _bind(environ)
    data = _BOUND[1]
    if data is None:
        return environ.get(name, default)
    key = _BOUND[2].get(name)
    if key is None:
        key = _BOUND[2][name] = environ.encodekey(name)
    raw = data.get(key)
    if raw is None:
        return default
    text = _BOUND[3].get(raw)
    if text is None:
        # Only the values our switches were ever set to are kept.
        text = _BOUND[3][raw] = environ.decodevalue(raw)
    return text


def _bind(environ) -> None:
    data = getattr(environ, "_data", None)
    usable = isinstance(data, dict) and all(hasattr(environ, a) for a in ("encodekey", "decodevalue"))
    _BOUND[:] = [environ, data if usable else None, {}, {}]
