"""What every measurement script under tests/cache writes: its command line, the environment
that moves its timings, and its result, printed and written where --out says."""
from __future__ import annotations

import json
import os
import sys

import mlx.core as mx


def bench_header(module: str, argv) -> dict:
    """The command as run (`module`: the script's module name; `argv`: main's argv, None for
    the process's), LD_PRELOAD (an allocator swap moves every time), MLX's version and device."""
    args = sys.argv[1:] if argv is None else argv
    return {"command": f"python -m {module} " + " ".join(args), "ld_preload": os.environ.get("LD_PRELOAD"),
            "mlx": mx.__version__, "device": str(mx.default_device())}


def emit(result: dict, out: str | None) -> None:
    """Print the result as indented JSON, and write it to `out` when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
