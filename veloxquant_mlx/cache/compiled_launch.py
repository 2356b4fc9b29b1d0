"""A cache's fused decode launch through mx.compile (fused_decode.COMPILED_LAUNCH, or a cache's
own `compiled_launch`): MLX traces the mx.fast.cuda_kernel call once and replays it at later
steps, so the call's host work (its template constants converted, hashed and written, the
kernel's whole source rebuilt from header and body, the inputs' signature written) runs at the
trace only.

Why: on the H200 a decode step of the 8B-shaped llama waits on the host where the GPU is fast
(session 33, results/gpu_speed_h200_s33_32k_b.json: fp16's steps host-bound in 32 of 32 rounds,
every cache of ours 0.81x-0.87x of its speed), and the Python function making the launch took
26-28 us of own time per layer and step under cProfile (results/host_profile_h200_s33_decode.json)
against ~3 us for mlx-lm's attention. A replay costs MLX's cache lookup and one new node.

What a replay needs: every array the launch reads passed as an argument (a closure's array would
be the trace's, not the step's), and the same shapes as the trace had (MLX traces again for new
shapes, and mx.compile's shapeless mode cannot infer a custom kernel's outputs). The decode
window's filled rows are therefore data here (`window_count`, read by the kernel as wn[0]) where
the shipped launch passes them as a view's length (fused_decode.window_rows, wn_shape[0]), and
the window must be the in-place buffers of fixed capacity (cache/window_buffer.py) rather than a
concatenation that grows every step. The store's arrays, the meta, the scratch and counters keep
their shapes between a launch plan's changes.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

# The counted build's body opens with this: its `wn_shape[0]` reads become `wn[0]`, the int32
# count `window_count` gives. The line also keeps "wn_shape" in the source, so MLX (and the CPU
# emulation) still declares the wn_shape parameter the kernel's text names.
COUNTED_PROLOGUE = "#define wn_shape wn\n"
COUNTED_EPILOGUE = "#undef wn_shape\n"

# What traces a launch. The CPU emulation of our kernels (tests/cache/cuda_emulation.py) runs
# them eagerly through numpy and cannot be traced: its tests set this to the identity.
compile_function = mx.compile


@lru_cache(maxsize=None)
def window_count(n: int) -> mx.array:
    """The counted build's `wn` input: an int32 (1,) array holding the window's filled rows.
    One per length, made once: an array made from Python data is already there (no launch, no
    evaluation), so later steps of the same length pass it as it is."""
    return mx.array([n], dtype=mx.int32)


class CompiledLaunch:
    """One cache's compiled launch of a fused decode kernel: a function traced by mx.compile per
    kernel, template, grid and output, kept while those stay (its launch plan's n_blocks or
    the queries' shape may change them; the inputs' shapes pick MLX's trace within it).
    `traces` counts the Python calls of the launch (the traces), for the tests and the bench."""

    def __init__(self):
        self.key = None
        self.function = None
        self.traces = 0
        # The last call's kernel, template object and launch shape: a step of the same launch
        # plan passes the very same kernel and template list, so the full key (the template's
        # constants compared one by one, ~2 us of host time a call) is built only when they differ.
        # (A template list is never changed in place: planned_attend's plans make new ones.)
        self._last = (None, None, None)

    def __call__(self, kernel, arrays: list, *, template, grid, threadgroup, output_shape, output_dtype):
        launch_shape = (grid, threadgroup, tuple(output_shape), output_dtype)
        last_kernel, last_template, last_shape = self._last
        if kernel is not last_kernel or template is not last_template or launch_shape != last_shape:
            self._renew(kernel, template, launch_shape)
        return self.replay(arrays)

    def replay(self, arrays: list):
        """The traced function of the last call's kernel, template and launch shape on these
        arrays (replay_step.ReplayStep calls it directly once a plan's launch is known)."""
        return self.function(*arrays)

    def _renew(self, kernel, template, launch_shape) -> None:
        """A new traced function where the kernel, the template's constants or the launch shape
        changed (a new launch plan with the same ones keeps the function and its traces)."""
        key = (kernel, tuple(template), *launch_shape)
        if self.key != key:
            # A new function: MLX keeps traces per function, and the old one's go with it.
            self.function = compile_function(self._launch(kernel, list(template), *launch_shape))
            self.key = key
        self._last = (kernel, template, launch_shape)

    def _launch(self, kernel, template, grid, threadgroup, output_shape, output_dtype):
        def launch(*arrays):
            self.traces += 1
            return kernel(inputs=list(arrays), template=template, grid=grid, threadgroup=threadgroup,
                          output_shapes=[output_shape], output_dtypes=[output_dtype])[0]
        return launch
