"""OpenBLAS preload for CPU runs (FACTS.md: fp32 matmul ~30x faster with it on Linux).

The library must be loaded before MLX starts, so a command that wants it re-executes itself
once with LD_PRELOAD set. Only done for the command-line entry points, never inside pytest,
and only when Debian's OpenBLAS is actually installed.
"""

from __future__ import annotations

import os
import sys

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
_MARK = "VELOXQUANT_OPENBLAS_REEXEC"


def openblas_loaded() -> bool:
    return OPENBLAS in os.environ.get("LD_PRELOAD", "")


def reexec_with_openblas() -> None:
    """Replace this process by itself with OpenBLAS preloaded, when that helps and is safe."""
    if (sys.platform != "linux" or openblas_loaded() or os.environ.get(_MARK)
            or not os.path.exists(OPENBLAS) or "pytest" in sys.modules):
        return
    argv = getattr(sys, "orig_argv", None)
    if not argv:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (OPENBLAS, env.get("LD_PRELOAD")) if p)
    env[_MARK] = "1"  # never loop, even if the preload is dropped by the loader
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
