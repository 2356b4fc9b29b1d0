"""A kernel's CUDA text without its comments and indentation, as it is handed to MLX.

Why: mx.fast.cuda_kernel's call rebuilds, hashes and copies the kernel's whole source (header,
signature, body) on the host at every launch, and the decode step makes one launch per layer.
On the H200 that host time grows with the text's size (session 35,
results/launch_cost_h200_s35.json: the decode launch's 65 KB source alone 36.7 us to build and
23.4 us to evaluate against 9.7 / 8.9 us for a small kernel), and a decode step of ours is
host-bound there. Our sources are written to be read, about half of their bytes comments and
indentation, which nvrtc never needs.

What is removed: `//` comments outside string literals (the asm statements' strings keep every
character), leading and trailing blanks of each line, and lines left empty. Line breaks stay,
so preprocessor directives and `\\` continuations keep their meaning; `/* */` comments, which
our kernels do not use, are left as written.
"""

from __future__ import annotations


def _without_line_comment(line: str) -> str:
    """`line` cut at its first `//` outside a string or character literal."""
    quote = None
    escaped = False
    for index, char in enumerate(line):
        if quote is not None:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char in "\"'":
            quote = char
        elif line.startswith("//", index):
            return line[:index]
    return line


def compact_kernel_text(text: str) -> str:
    """`text` (a kernel's source or header) without comments, indentation and empty lines."""
    lines = (_without_line_comment(line).strip() for line in text.splitlines())
    kept = [line for line in lines if line]
    return "\n".join(kept) + "\n" if kept else ""
