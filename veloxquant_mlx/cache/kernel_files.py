"""A kernel's header and body handed to MLX as two `#include` lines of files holding them.

Why: MLX's CUDA backend keeps a custom kernel's whole text (its header, the signature MLX
writes, the body) in the launch's primitive, and a launch's host time grows with that text's
size even where mx.compile replays the launch (on the H200, results/launch_cost_h200_s36.json:
the decode launch's compacted text took 13.96 us per node to evaluate when replayed, where a
kernel of the same 24 inputs and one output with next to no text took 8.75 us evaluated eagerly).
A host-bound decode step makes one such launch per layer. nvrtc reads an `#include` of an
absolute path from the file system when it compiles, so the text MLX holds shrinks to the two
lines and the signature, and the kernel compiled is the same. Measured on an H100 (session 41,
results/launch_cost_h100_s41.json): the replayed decode launch's evaluation 12.65 us with the
compacted text inline, 6.65 us from the files, 6.61 us for the same inputs with next to no text.

How: the compacted header and body are written once per process and kernel to
`<folder>/<keyed name>.header.cuh` and `.body.cuh`, the folder VELOXQUANT_KERNEL_TEXT_DIR or
`<tmp>/veloxquant_mlx-<uid>/kernel_text` (created for this user alone; a folder of another
user's is an error). The keyed name carries a digest of both texts
(kernel_name.source_keyed_name), so files of different texts never share a name; an existing
file is read back and rewritten (write to a temporary file, then rename) unless it holds the
text, so a stale or partial file is never compiled. MLX declares a `<input>_shape`, `_strides`
or `_ndim` parameter where its name appears in the body it is given: the body handed over
keeps, as a comment, each such name the file's body reads, so the signature is the inline one.

VELOXQUANT_KERNEL_TEXT_FILES=0 hands MLX the text inline, as before (for A/B measurements);
any value other than 0 or 1 is an error.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from veloxquant_mlx.cache import environment_switch
from veloxquant_mlx.errors import QuantizerConfigError

ENV_SWITCH = "VELOXQUANT_KERNEL_TEXT_FILES"
ENV_FOLDER = "VELOXQUANT_KERNEL_TEXT_DIR"
# The parameter suffixes MLX's cuda_kernel looks for in a body (custom_kernel.cpp, shape_infos).
SHAPE_SUFFIXES = ("_shape", "_strides", "_ndim")


def enabled() -> bool:
    """True unless VELOXQUANT_KERNEL_TEXT_FILES is 0 (read at each kernel's build)."""
    switch = environment_switch.value(ENV_SWITCH, "1")
    if switch not in ("0", "1"):
        raise QuantizerConfigError(
            f"environment variable {ENV_SWITCH}={switch!r} is invalid: allowed is 0 (kernel text "
            "handed to MLX inline) or 1 (header and body read by nvrtc from files, the default)"
        )
    return switch == "1"


def folder() -> Path:
    """Where the files go: VELOXQUANT_KERNEL_TEXT_DIR, else <tmp>/veloxquant_mlx-<uid>/kernel_text
    (a user's own: nvrtc compiles what the files hold, so no other user may write them)."""
    chosen = environment_switch.value(ENV_FOLDER)
    if chosen:
        return Path(chosen)
    return Path(tempfile.gettempdir()) / f"veloxquant_mlx-{os.getuid()}" / "kernel_text"


def included_texts(keyed_name: str, source: str, header: str, input_names) -> tuple[str, str]:
    """(source, header) to hand MLX in place of `source` and `header`: an #include of each
    one's file (an empty header stays empty), the body's shape parameters named after it."""
    where = folder()
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise QuantizerConfigError(
            f"{ENV_FOLDER}: cannot create the kernel text folder {str(where)!r} ({exc}); set "
            f"{ENV_FOLDER} to a writable folder, or {ENV_SWITCH}=0 to hand MLX the text inline"
        ) from exc
    # The folder this user's; its parent this user's or root's (whose owner could swap the folder).
    for held, owners in ((where, (os.getuid(),)), (where.parent, (os.getuid(), 0))):
        owner = held.stat().st_uid
        if owner not in owners:
            raise QuantizerConfigError(
                f"{ENV_FOLDER}: for the kernel text folder {str(where)!r}, {str(held)!r} belongs to "
                f"another user (uid {owner}, this process runs as {os.getuid()}), who could change what "
                f"nvrtc compiles; set {ENV_FOLDER} to a folder of your own, or {ENV_SWITCH}=0"
            )
    body = _include_line(_written(where / f"{keyed_name}.body.cuh", source))
    named = shape_parameters(source, input_names)
    if named:
        body += "// " + " ".join(named) + "\n"
    head = _include_line(_written(where / f"{keyed_name}.header.cuh", header)) if header else ""
    return body, head


def shape_parameters(source: str, input_names) -> list:
    """The parameters MLX's cuda_kernel declares beyond the arrays for a body `source`: each
    input's `_shape`, `_strides`, `_ndim` where the body names it (custom_kernel.cpp, a plain
    substring search)."""
    return [n + suffix for n in input_names for suffix in SHAPE_SUFFIXES if n + suffix in source]


def _include_line(path: Path) -> str:
    text = str(path)
    if '"' in text or "\n" in text:
        raise QuantizerConfigError(
            f"{ENV_FOLDER}: the kernel text folder {str(path.parent)!r} cannot be named in an "
            f"#include (it holds a quote or a line break); choose another, or set {ENV_SWITCH}=0"
        )
    return f'#include "{text}"\n'


def _written(path: Path, text: str) -> Path:
    """`path`, holding `text` (written through a temporary file and a rename where it does
    not already hold it: processes building the same kernel at once each write whole files)."""
    try:
        if path.read_text() == text:
            return path
    except (OSError, UnicodeDecodeError):
        pass
    try:
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp",
                                         delete=False) as f:
            f.write(text)
        os.replace(f.name, path)
    except OSError as exc:
        raise QuantizerConfigError(
            f"{ENV_FOLDER}: cannot write the kernel text file {str(path)!r} ({exc}); set {ENV_FOLDER} "
            f"to a writable folder, or {ENV_SWITCH}=0 to hand MLX the text inline"
        ) from exc
    return path
