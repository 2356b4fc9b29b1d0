"""Kernels built under a name that carries a digest of their source.

Why: MLX's CUDA backend keys a custom kernel's compiled module by its name and template
arguments alone (custom_kernel.cpp: "custom_kernel_" + name + the template values), in memory
for the process and on disk in MLX_PTX_CACHE_DIR (by default <tmp>/mlx/<mlx version>/ptx, kept
across processes and across upgrades of this package). A kernel whose source differs under the
same name (another version of ours, a source built from arguments such as gear's prefill
kernel's block-count input or kvquant's MIN_SCALE, the merge-fused and split builds) would run
the binary compiled first, with the parameter list of another source."""
from __future__ import annotations

import hashlib

import mlx.core as mx

from . import kernel_files
from .kernel_text import compact_kernel_text

# Between the name given and the digest; base_name() cuts there.
DIGEST_MARK = "__src"
# MLX's kernel factory as imported, before a test may stand its CPU emulation in for it (where
# MLX has no CUDA backend the attribute exists and raises at the call).
_MLX_FACTORY = getattr(mx.fast, "cuda_kernel", None)


def source_keyed_name(name: str, source: str, header: str = "") -> str:
    """`name` with a digest of the header and source appended: equal sources share a name,
    and so MLX's cached module, different ones do not."""
    digest = hashlib.sha256(f"{header}\0{source}".encode()).hexdigest()[:12]
    return f"{name}{DIGEST_MARK}{digest}"


def base_name(name: str) -> str:
    """The name as written in our code, without the digest (what tests and reports name)."""
    return name.split(DIGEST_MARK, 1)[0]


def build_kernel(factory, *, name: str, source: str, header: str = "", compact: bool = True, files: bool = True,
                 **arguments):
    """factory (mx.fast.cuda_kernel, or a test's stand-in for it) called with the source and
    header compacted (kernel_text: MLX copies them at every launch; `compact` False: as written,
    for the bench's paired ablation) under a name keyed by the text handed over, what nvrtc
    compiles; the other arguments pass through. MLX's own factory gets the compacted texts as
    #include lines of files holding them (kernel_files; VELOXQUANT_KERNEL_TEXT_FILES=0: inline);
    a stand-in (the CPU emulation of the tests), the verbatim build and `files` False (the
    bench's inline ablation) get the texts."""
    if compact:
        source, header = compact_kernel_text(source), compact_kernel_text(header)
    keyed = source_keyed_name(name, source, header)
    if compact and files and factory is _MLX_FACTORY and kernel_files.enabled():
        source, header = kernel_files.included_texts(keyed, source, header, arguments.get("input_names", ()))
    return factory(name=keyed, source=source, header=header, **arguments)
