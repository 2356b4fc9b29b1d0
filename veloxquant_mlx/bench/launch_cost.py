"""Host time of one MLX op against one mx.fast.cuda_kernel call, per call (MLX's CUDA backend).

    python -m veloxquant_mlx.bench.launch_cost --out results/launch_cost_h200.json

Why: on the H200 a decode step of the 8B-shaped llama is bound by the host (each token's host
time, its graph built and handed to async_eval, is its whole interval; gpu_speed --interleave
records it per round as host_ms), so what a cache adds per layer and step is host time: its
Python, and each op and kernel call it builds and MLX launches. This times, 2000 calls each:
`build` (the Python call that makes the lazy node) and `eval` (mx.eval of the 2000 independent
nodes: MLX's encoding and launch of each), for a built-in op on small arrays (mx.add,
mx.concatenate of a 128-token window and one token, a one-token slice write into a window buffer
as mlx-lm's KVCache does, an int32 array made from a Python list as a kernel's `meta`) and for a
trivial custom kernel with a partials kernel's interface (12 inputs, 3 outputs, 9 template
constants): as is, with `init_value` (MLX fills every output first), with one output, and with
the shared header of our decode kernels (MLX rebuilds the whole source string per call); then
with one output and a decode launch's 24 inputs, its 27 template constants, its source's size,
and all three (`cuda_kernel_decode_shaped`: the host cost of the call our decode steps make,
for a kernel that does next to nothing), and that call through mx.compile (`_compiled`: MLX
replays the traced call, as `add_compiled` does mx.add and `concatenate_24_inputs_compiled` a
one-node function of 24 inputs, the cost of a replay on any device). `_compact` cases: the same
call with the header and source at the sizes cache/kernel_text leaves (comments and indentation
gone), the text our decode launches hand MLX since session 36. `cuda_kernel_decode_counts_compiled`: the
decode launch's inputs, constants and output with the trivial kernel's text, replayed;
`cuda_kernel_decode_included_compiled`: the compacted case with its header and source in files
that the text handed to MLX #includes (cache/kernel_files.py), replayed (a case whose compile
fails, nvrtc not reading the include, is reported with its error). Medians of 5 rounds, the
first untimed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

CALLS = 2000
ROUNDS = 5
_SOURCE = "  const int i = threadIdx.x + blockIdx.x * blockDim.x; if (i < 1024) out[i] = x0[i] + (float)N;"


_TEMPLATE = [("N", 3), ("D", 128), ("R", 4), ("G", 32), ("KB", 2), ("VB", 2), ("LPT", 8),
             ("QT", mx.bfloat16), ("ST", mx.bfloat16)]
# A decode launch's counts (GEAR's fused build, the 8B shape: 21 inputs of its own plus the
# fused merge's 3, 27 template constants, one output) and its source's size (~41 KB beside the
# ~24 KB header), the source padded to it with a comment. Why: on the H200 (session 33,
# results/host_profile_h200_s33_decode.json) the Python function that makes that call
# (fused_decode.PartialsKernel.attend) took 26-28 us of own time per layer and step under
# cProfile, where this module's 12-input call took ~11 us to build in session 10: these cases
# say which of inputs, template constants or source size the difference is.
DECODE_INPUTS = 24
DECODE_TEMPLATE = _TEMPLATE + [(f"C{i}", i) for i in range(15)] + [("IT", mx.uint16), ("JT", mx.uint16), ("B", 1)]
DECODE_SOURCE_BYTES = 41_000


def _compact_decode_source_bytes() -> int:
    """The size of GEAR's fused decode source as build_kernel hands it to MLX (compacted)."""
    from veloxquant_mlx.cache import fused_decode_gear
    from veloxquant_mlx.cache.kernel_text import compact_kernel_text

    return len(compact_kernel_text(fused_decode_gear._partials_kernel().fused_source()))


def _padded_source(size: int) -> str:
    """_SOURCE after a comment that brings it to `size` bytes (NVRTC skips it)."""
    pad = max(0, size - len(_SOURCE) - 4)
    return "// " + "x" * pad + "\n" + _SOURCE


def _input_names(count: int) -> list:
    return [f"x{i}" for i in range(count)]


def _custom_call(*, outputs: int = 3, header: str = "", inputs: int = 12, template=None, source: str = _SOURCE,
                 compiled: bool = False, **launch):
    """A call of the trivial kernel (`outputs` of its three; `header` prepended; `inputs` arrays;
    `template` constants (None: _TEMPLATE); `source`: the kernel's, padded or not; `compiled`:
    through mx.compile, the arrays its arguments; `launch`: more of the call's keywords, e.g.
    init_value)."""
    names = ["out", "o2", "o3"][:outputs]
    template = _TEMPLATE if template is None else template
    kernel = mx.fast.cuda_kernel(name=f"vq_launch_cost_{outputs}_{len(header)}_{inputs}_{len(template)}_{len(source)}",
                                 input_names=_input_names(inputs),
                                 output_names=names, source=source, header=header)
    xs = [mx.zeros((1024,), mx.float32) for _ in range(inputs)]
    mx.eval(xs)
    shapes = [(1024,), (8, 4), (8, 4)][:outputs]

    def call(*arrays):
        return kernel(inputs=list(arrays), template=template, grid=(1024, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=shapes, output_dtypes=[mx.float32] * outputs, **launch)
    return _bound(call, xs, compiled)


def _included(case: dict) -> dict:
    """`case` with its header and source handed over as the shipped builds hand theirs: an
    #include of a file holding each (kernel_files.included_texts; nvrtc reads them at the compile)."""
    from veloxquant_mlx.cache import kernel_files
    from veloxquant_mlx.cache.kernel_name import source_keyed_name

    name = source_keyed_name("vq_launch_cost_included", case["source"], case["header"])
    source, header = kernel_files.included_texts(name, case["source"], case["header"], _input_names(case["inputs"]))
    return dict(case, source=source, header=header)


def _bound(function, arrays: list, compiled: bool):
    """`function` of `arrays`, as a call of no arguments; through mx.compile when `compiled`
    (the traced graph replayed by MLX at each call: no Python builds the op again)."""
    function = mx.compile(function) if compiled else function
    return lambda: function(*arrays)


def _concatenated(*arrays):
    return mx.concatenate(list(arrays))


def _window_write():
    """A one-token write at the next slot of a window buffer (mlx-lm KVCache's update): each
    call's node takes the last one's buffer, so MLX writes in place as in a decode."""
    buffer = [mx.zeros((1, 8, CALLS + 1, 128), mx.bfloat16)]
    token = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    mx.eval(buffer[0], token)
    at = [0]

    def write():
        at[0] = at[0] % CALLS + 1
        buffer[0][:, :, at[0] - 1:at[0], :] = token
        return buffer[0]
    return write


def time_calls(make) -> dict:
    """Median microseconds per call to build, and per node to evaluate."""
    build, evaluate = [], []
    for r in range(ROUNDS + 1):
        t0 = time.perf_counter()
        outs = [make() for _ in range(CALLS)]
        t1 = time.perf_counter()
        mx.eval(outs)
        t2 = time.perf_counter()
        if r:
            build.append(1e6 * (t1 - t0) / CALLS)
            evaluate.append(1e6 * (t2 - t1) / CALLS)
    return {"build_us": statistics.median(build), "eval_us": statistics.median(evaluate),
            "build_us_range": [min(build), max(build)], "eval_us_range": [min(evaluate), max(evaluate)]}


def run() -> dict:
    a = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    b = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    window = mx.zeros((1, 8, 128, 128), mx.bfloat16)
    mx.eval(a, b, window)
    many = [mx.zeros((4,), mx.float32) for _ in range(DECODE_INPUTS)]
    mx.eval(many)
    cases = {"add": lambda: mx.add(a, b), "add_compiled": _bound(mx.add, [a, b], True),
             # One node of a decode launch's 24 inputs, built and replayed: what a replay of
             # that many inputs costs per call, on any device.
             "concatenate_24_inputs": _bound(_concatenated, many, False),
             "concatenate_24_inputs_compiled": _bound(_concatenated, many, True),
             "concatenate": lambda: mx.concatenate([window, b], axis=2),
             "window_write": _window_write(), "meta_from_list": lambda: mx.array([3, 128, 0, 7], dtype=mx.int32)}
    failed = {}
    from veloxquant_mlx.cache.fused_decode import _on_cuda
    from veloxquant_mlx.cache.kernel_header import HEADER

    if _on_cuda():

        from veloxquant_mlx.cache.kernel_text import compact_kernel_text

        decode_shaped = dict(outputs=1, header=HEADER, inputs=DECODE_INPUTS, template=DECODE_TEMPLATE,
                             source=_padded_source(DECODE_SOURCE_BYTES))
        compact = dict(decode_shaped, header=compact_kernel_text(HEADER),
                       source=_padded_source(_compact_decode_source_bytes()))
        variants = {"cuda_kernel": _custom_call(), "cuda_kernel_init_value": _custom_call(init_value=0),
                    "cuda_kernel_one_output": _custom_call(outputs=1),
                    "cuda_kernel_decode_header": _custom_call(header=HEADER),
                    # One output from here on, as the fused decode launch has.
                    "cuda_kernel_24_inputs": _custom_call(outputs=1, inputs=DECODE_INPUTS),
                    "cuda_kernel_27_constants": _custom_call(outputs=1, template=DECODE_TEMPLATE),
                    "cuda_kernel_decode_source": _custom_call(outputs=1, header=HEADER,
                                                              source=decode_shaped["source"]),
                    "cuda_kernel_decode_shaped": _custom_call(**decode_shaped),
                    "cuda_kernel_decode_shaped_compiled": _custom_call(**decode_shaped, compiled=True),
                    "cuda_kernel_decode_shaped_compact": _custom_call(**compact),
                    "cuda_kernel_decode_shaped_compact_compiled": _custom_call(**compact, compiled=True),
                    # The decode launch's counts with next to no text, and with its text read by
                    # nvrtc from files (#include of an absolute path): does a replay's evaluation
                    # pay for the text the kernel carries?
                    "cuda_kernel_decode_counts_compiled": _custom_call(outputs=1, inputs=DECODE_INPUTS,
                                                                       template=DECODE_TEMPLATE, compiled=True),
                    "cuda_kernel_decode_included_compiled": _custom_call(**_included(compact), compiled=True)}
        for name, call in variants.items():
            try:
                mx.eval(call())  # its JIT compile, untimed
            except RuntimeError as exc:  # nvrtc's error (an #include it cannot read): reported
                failed[name] = str(exc)
                continue
            cases[name] = call
    timed = {name: time_calls(make) for name, make in cases.items()}
    return dict(timed, **{name: {"error": error} for name, error in failed.items()})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.launch_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON output path (default: stdout only)")
    args = parser.parse_args(argv)
    from veloxquant_mlx.bench.report import machine_info

    result = {"command": "python -m veloxquant_mlx.bench.launch_cost" + (f" --out {args.out}" if args.out else ""),
              "machine": machine_info(), "calls": CALLS, "rounds": ROUNDS, "cases": run()}
    for name, case in result["cases"].items():
        if "error" in case:
            print(f"{name}: failed: {case['error']}")
            continue
        print(f"{name}: build {case['build_us']:.2f} us/call, eval {case['eval_us']:.2f} us/node")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
