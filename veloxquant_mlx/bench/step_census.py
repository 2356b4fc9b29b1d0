"""What one decode step builds and launches, per method: the host side of decode speed on CUDA.

    python -m veloxquant_mlx.bench.step_census --out results/step_census_cpu.json
    python -m veloxquant_mlx.bench.step_census --methods fp16,xquant --history 1024 --layers 2 \
        --out /tmp/census.json                                        # quick look
    python -m veloxquant_mlx.bench.step_census --out results/step_census_h200.json   # on the H200:
        # --stand-ins auto is off there: the real kernels run, the host times are the H200 host's

Why: on the H200 one layer's fused attention kernel takes ~0.09 ms at 32K tokens, while the
fp16 step is ~2.0-2.6 ms for 8 layers; every extra primitive per layer and step costs a launch
(~5-10 us on CUDA) and host time to build the graph (MLX builds each step's graph in Python).
This counts, on the CPU, what each method's decode step adds, taking the path it takes on CUDA.

How (per method; fp16 is mlx-lm's KVCache with mlx-lm's attention; a marked ablation such as
`kivi-compiled` or `kivi-inplace` is its method's caches with its attributes set, so
`--methods fp16,kivi,kivi-compiled` sets a switch beside the shipped path; either takes config
fields as gpu_speed's specs do, `minicache:minicache_start_fraction=0.0`; under the stand-ins a
compiled launch is recorded at each call, its replay's time left in the build time, where a
plain launch's stand-in time is taken out):
  * the caches come from `patch_model_kv_cache` on a random mlx-lm llama with the 8B attention
    shape (32 query / 8 KV heads, head_dim 128, bf16; a small hidden size and MLP, which the
    caches never see), so cross-layer methods pair up as they do in a model and the attention
    dispatcher is the installed one; each layer's step is the patched attention's own calls:
    `cache.update_and_fetch(k, v)` then the module's `scaled_dot_product_attention(q, k, v,
    cache=cache, scale=..., mask=None)` (mlx-lm's mask at a one-token step);
  * the history (`--history` tokens) is prefilled in chunks with the portable path (real values);
  * the decode steps run with CUDA's Python-side choices: the kernels' switch is its own
    function (`fused_decode.kernels_enabled`, VELOXQUANT_CUDA_KERNELS as set, its host time in
    the step's) finding MLX's CUDA backend (`fused_decode._cuda_available` answers True) and
    `mx.default_device()` answering the GPU, to it and to the caches' branches,
    and `mx.fast.cuda_kernel` replaced by a recorder: each launch becomes one lazy
    `mx.depends(placeholders, inputs)` node (placeholders of the output shapes, made once), so
    the step's graph is the one CUDA would get, with one node per kernel launch, and evaluating
    it costs nothing (its values are not the kernel's: only shapes and the graph count here);
    likewise `mx.fast.scaled_dot_product_attention` of one query row (MLX's CUDA backend runs
    it as one fused primitive, sdpa_vector, where the CPU stream composes ~10 ops) and
    `mx.dequantize` (one primitive on the GPU stream, ~5 ops per bit position on the CPU's);
    mx.compile traces made under these stand-ins stay in their functions' caches, so the
    census runs in a process of its own (the command; the tests run it in a subprocess);
  * the graph: `mx.export_to_dot` over each layer's attention output and the cache's state
    arrays (window and store: a flush writes them after the attention, and the next step reads
    them), new nodes only (everything is evaluated between steps, as mlx-lm's generate
    evaluates each token); a node reached from several layers counts for the first one;
  * host build time: `time.perf_counter` around each layer's two calls (no evaluation), less
    the time spent in the recorder (its mx.depends is not the real launch call: the figure is
    the host time of everything but the kernel / fused-op calls themselves, which a real launch
    adds per launch), median and quartiles over layers x steps;
  * `--steps` defaults to 256: whole blocks of every method (block sizes 32..256 divide it)
    and one growth of the compressed store and of fp16's KVCache (both grow 256 tokens at a
    time), so flushes and growth are inside the averages in their real proportion.

Primitive names are MLX's (`Concatenate`, `AsType`, ...), `CustomKernel:<name>` for a kernel
launch. `launches` counts primitives that run a kernel on CUDA: everything except the ones that
only make a view there (VIEW_PRIMITIVES: Broadcast, Reshape of a contiguous array, Slice,
Transpose, ...; a Reshape that must copy does launch, so the figure is a lower bound).
`host_syncs` counts mx.eval / mx.async_eval calls made inside the step (each drains the GPU
queue); an `.item()` inside the step would not be counted: none of the decode paths has one.

On this 2-core VM run it pinned to one core (`taskset -c 1 python -m ...`): unpinned, whole
processes ran ~2x slower at random (session 37), which the medians of one run do not show.

What it cannot tell: GPU time, the real kernel's per-launch cost, how MLX's CUDA backend
batches the launches it is handed (the census counts them before that). Figures of host build time
come from this machine's CPU and Python, not the H200's host; read them as ratios to fp16.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import pkgutil
import platform
import re
import statistics
import sys
import time
from collections import Counter

import mlx.core as mx

from veloxquant_mlx.cache.kernel_name import base_name

METHODS = ("fp16", "kivi", "xquant", "turboquant_rvq", "minicache", "gear", "kvquant", "pyramidkv")
LLAMA_8B_ATTENTION = dict(heads=32, kv_heads=8, head_dim=128)
KERNEL = "CustomKernel"
DEFAULT_STEPS = 256  # CompressedKVCache.step and mlx-lm KVCache.step: one growth of each
# Primitives that make a view (no kernel) on MLX's CUDA backend: Broadcast/Slice/Transpose/
# ExpandDims/Squeeze/AsStrided set strides; Reshape does when the input's strides allow (the
# common case; a copying Reshape is counted here too, so `launches` is a lower bound); Depends
# only orders. The recorder's kernel node is a Depends: counted as a launch under KERNEL.
VIEW_PRIMITIVES = frozenset({
    "Broadcast", "Reshape", "Slice", "Transpose", "ExpandDims", "Squeeze", "AsStrided",
    "Depends", "StopGradient", "Unflatten", "Flatten",
})
_EVAL = mx.eval
_NODE = re.compile(r'\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}')


# ---- the graph ------------------------------------------------------------------------------
def primitive_id(array: mx.array) -> int | None:
    """The id (as export_to_dot writes it) of the primitive that makes `array`; None when the
    array is already evaluated (no primitive left)."""
    text = io.StringIO()
    mx.export_to_dot(text, array)
    dot = text.getvalue()
    # Every array nothing in the graph reads is a sink, the unread outputs of a multi-output
    # primitive (a split, a launch's other outputs) too, before it: `array` is the last one.
    sinks = re.findall(r'\{ rank=sink; "([^"]+)"; \}', dot)
    if not sinks:
        return None
    return int(re.search(rf'(\d+) -> "{re.escape(sinks[-1])}"', dot).group(1))


def graph_nodes(outputs) -> list[tuple[int, str]]:
    """(primitive id, name) of every not yet evaluated array's primitive that the arrays depend
    on, once per array (siblings of a multi-output primitive once); MLX's dot export stops at
    evaluated arrays. Ids are not unique: the calls of one mx.compile'd function share their
    primitives, so a node is an entry of this list, not an id."""
    arrays = [a for a in outputs if isinstance(a, mx.array)]
    if not arrays:
        return []
    text = io.StringIO()
    mx.export_to_dot(text, *arrays)
    return [(int(i), name) for i, name in _NODE.findall(text.getvalue())]


def graph_counts(outputs, launched: dict[int, str]) -> Counter:
    """Primitive names -> count over the arrays' unevaluated graph; the recorder's nodes
    (`launched`: id -> what it stands for) by what they stand for."""
    return Counter(launched.get(i, name) for i, name in graph_nodes(outputs))


class KernelRecorder:
    """Stands in for mx.fast.cuda_kernel: each launch of a built kernel records its name and
    returns `mx.depends(placeholders, inputs)`, one lazy node whose inputs are the launch's.
    `fused` does the same for an MLX op that is one primitive on CUDA but a composition of
    ops on the CPU stream (see cuda_path)."""

    def __init__(self):
        self.launches: list = []  # (what it stands for, its first output)
        self.seconds = 0.0
        self._placeholders: dict = {}

    def __call__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False):
        def launch(*, inputs, output_shapes, output_dtypes, **_):
            specs = [(tuple(s), d) for s, d in zip(output_shapes, output_dtypes)]
            return self.record(f"{KERNEL}:{base_name(name)}", specs, inputs)

        launch.kernel_name = base_name(name)
        return launch

    def record(self, label: str, specs, inputs) -> list:
        t0 = time.perf_counter()
        outs = [self._placeholder(shape, dtype) for shape, dtype in specs]
        outs = mx.depends(outs, [a for a in inputs if isinstance(a, mx.array)])
        self.launches.append((label, outs[0]))
        # Its own time (mx.depends alone is ~12 us) is not the real launch call's: the census
        # takes it out of the build time (see decode_steps).
        self.seconds += time.perf_counter() - t0
        return outs

    def _placeholder(self, shape, dtype) -> mx.array:
        key = (shape, dtype)
        if key not in self._placeholders:
            # Made (and evaluated) once per shape; by the unwrapped eval, so counting_syncs does
            # not count it as the step's (it is the census's own).
            self._placeholders[key] = mx.zeros(shape, dtype)
            _EVAL(self._placeholders[key])
        return self._placeholders[key]


# Head dims of MLX's fused one-row attention on CUDA (mlx/backend/cuda/
# scaled_dot_product_attention.cpp, supports_sdpa_vector, MLX 0.32): elsewhere, and for longer
# queries, CUDA composes it of ops as the CPU does.
SDPA_VECTOR_HEAD_DIMS = (64, 96, 128, 256)


def _fast_sdpa_stand_in(recorder: KernelRecorder, original):
    def scaled_dot_product_attention(q, k, v, *, scale, mask=None, sinks=None, stream=None):
        one_row = q.shape[2] <= 1 <= k.shape[2]
        if (one_row and q.shape[-1] == v.shape[-1] and q.shape[-1] in SDPA_VECTOR_HEAD_DIMS
                and not isinstance(mask, mx.array) and stream is None):
            shape = (*q.shape[:-1], v.shape[-1])
            inputs = [q, k, v] + ([sinks] if isinstance(sinks, mx.array) else [])
            return recorder.record("ScaledDotProductAttention", [(shape, q.dtype)], inputs)[0]
        return original(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream)

    return scaled_dot_product_attention


def _dequantize_stand_in(recorder: KernelRecorder, original):
    """mx.dequantize is one primitive on the GPU stream (fast::affine_dequantize) but ~5 ops per
    packed bit position on the CPU's."""
    def dequantize(w, scales, biases=None, group_size=None, bits=None, mode="affine", dtype=None, **kw):
        if mode != "affine" or bits is None or group_size is None or biases is None or kw:
            return original(w, scales, biases, group_size, bits, mode=mode, dtype=dtype, **kw)
        shape = (*w.shape[:-1], w.shape[-1] * 32 // bits)
        return recorder.record("Dequantize", [(shape, dtype or scales.dtype)], [w, scales, biases])[0]

    return dequantize


def kernel_factories() -> list:
    """The lru-cached kernel factories of veloxquant_mlx.cache's fused_* / *_kernel modules:
    emptied, they build their kernels anew with whatever mx.fast.cuda_kernel is then."""
    import veloxquant_mlx.cache as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("fused_") or info.name.endswith("_kernel"):
            module = importlib.import_module(f"veloxquant_mlx.cache.{info.name}")
            found += [f for f in vars(module).values() if callable(f) and hasattr(f, "cache_clear")]
    return found


@contextlib.contextmanager
def cuda_path(recorder: KernelRecorder):
    """Within: the caches take the path they take on MLX's CUDA backend (kernels on, the GPU as
    the default device for their Python-side branches), kernels built by `recorder`."""
    from veloxquant_mlx.cache import fused_decode
    from veloxquant_mlx.cache.compiled_launch import CompiledLaunch

    factories = kernel_factories()
    saved = (mx.fast.cuda_kernel, mx.fast.scaled_dot_product_attention, mx.dequantize,
             mx.default_device, fused_decode._cuda_available)
    saved_replay = CompiledLaunch.replay

    def replay(self, arrays):
        # A compiled launch calls the recorder at its trace only: each replay is recorded here,
        # its output the step's node (the trace's own record, of a node no step reaches, dropped).
        # Its time stays in the build time: a replay is MLX's host work, as the real one is.
        first = len(recorder.launches)
        out = saved_replay(self, arrays)
        del recorder.launches[first:]
        recorder.launches.append((f"{KERNEL}:{self.key[0].kernel_name}", out))
        return out
    gpu = mx.Device(mx.gpu, 0)
    for f in factories:
        f.cache_clear()
    mx.fast.cuda_kernel = recorder
    mx.fast.scaled_dot_product_attention = _fast_sdpa_stand_in(recorder, saved[1])
    mx.dequantize = _dequantize_stand_in(recorder, saved[2])
    mx.default_device = lambda: gpu
    # The switch's own function runs (its host time is the step's, as on CUDA): it finds the
    # CUDA backend and the GPU as the default device.
    fused_decode._cuda_available = lambda: True
    CompiledLaunch.replay = replay
    try:
        yield recorder
    finally:
        (mx.fast.cuda_kernel, mx.fast.scaled_dot_product_attention, mx.dequantize,
         mx.default_device, fused_decode._cuda_available) = saved
        CompiledLaunch.replay = saved_replay
        for f in factories:
            f.cache_clear()


@contextlib.contextmanager
def counting_syncs():
    """Within: mx.eval / mx.async_eval calls are counted (list of one int, yielded)."""
    count = [0]
    saved = mx.eval, mx.async_eval

    def wrap(function):
        def counted(*args, **kwargs):
            count[0] += 1
            return function(*args, **kwargs)
        return counted

    mx.eval, mx.async_eval = wrap(saved[0]), wrap(saved[1])
    try:
        yield count
    finally:
        mx.eval, mx.async_eval = saved


# ---- the caches and one step ----------------------------------------------------------------
def state_arrays(cache) -> list:
    """The arrays a cache carries to its next step (window and store; fp16's keys / values).
    A growing window (cache/growing_window.py) is its buffers: its window_keys property would
    make a new slice at each read, a node of the census's own."""
    if hasattr(cache, "store"):
        window = [cache.__dict__.get("_window_k"), cache.__dict__.get("_window_v")]
        if window[0] is None:
            window = [cache.window_keys, cache.window_values]
        arrays = [*window, *cache.store.values()]
    else:
        arrays = [getattr(cache, "keys", None), getattr(cache, "values", None)]
    return [a for a in arrays if isinstance(a, mx.array)]


def marked_ablations() -> dict:
    """The ablations that are a method's own caches with attributes set (ablations.Marked):
    name -> (the marker, the method)."""
    from veloxquant_mlx.bench.ablations import ABLATIONS, Marked

    return {name: (build, method) for name, (build, method, _) in ABLATIONS.items() if isinstance(build, Marked)}


@contextlib.contextmanager
def method_caches(method: str, model):
    """(cache list, the attention function the model's layers call) for `method`, a method or
    a marked ablation (its method's caches, marked)."""
    from mlx_lm.models import base
    from mlx_lm.models.cache import make_prompt_cache

    name, _, fields = method.partition(":")  # `minicache:minicache_start_fraction=0.0`, as gpu_speed takes
    marked = marked_ablations().get(name)
    if marked is not None:
        marker, of_method = marked
        with method_caches(of_method + (":" + fields if fields else ""), model) as (caches, attention):
            yield marker.mark(caches), attention
        return
    if method == "fp16":
        yield make_prompt_cache(model), base.scaled_dot_product_attention
        return
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec
    from veloxquant_mlx.config import KVCacheConfig
    from veloxquant_mlx.errors import QuantizerConfigError
    from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache

    # The config method_list checked: the method and its fields, parsed as gpu_speed parses them.
    spec = parse_layer_spec(method)
    if spec.kind != "ours":  # an ablation with a class of its own, mlx-lm's quantized cache
        raise QuantizerConfigError(f"step_census: {method!r} is not one of our methods or a marked "
                                   "ablation (see method_list)")
    caches = patch_model_kv_cache(model, KVCacheConfig.from_dict(spec.params))
    try:
        module = sys.modules[type(model.model.layers[0].self_attn).__module__]
        yield caches, module.scaled_dot_product_attention
    finally:
        unpatch_model_kv_cache(model)


def _random(shape, dtype, key) -> mx.array:
    return (mx.random.normal(shape, key=mx.random.key(key)) * 0.5).astype(dtype)


def prefill(caches, attention, *, history: int, chunk: int, kv_heads: int, heads: int, head_dim: int,
            dtype, seed: int) -> None:
    """`history` tokens into every cache, `chunk` at a time, portable path. Each chunk's
    attention takes one query row (the last position: the same flushes, a fraction of a full
    chunk's attention work, which in bf16 on the CPU would take minutes)."""
    scale = head_dim ** -0.5
    for start in range(0, history, chunk):
        n = min(chunk, history - start)
        for i, cache in enumerate(caches):
            key = 4 * ((seed * 1_000_003 + start) * 256 + i)
            k = _random((1, kv_heads, n, head_dim), dtype, key)
            v = _random((1, kv_heads, n, head_dim), dtype, key + 1)
            q = _random((1, heads, 1, head_dim), dtype, key + 2)
            keys, values = cache.update_and_fetch(k, v)
            out = attention(q, keys, values, cache=cache, scale=scale, mask=None)
            mx.eval(out, *state_arrays(cache))


def decode_steps(caches, attention, *, steps: int, kv_heads: int, heads: int, head_dim: int, dtype,
                 seed: int, recorder: KernelRecorder):
    """Runs `steps` decode steps; per step and layer: build seconds, primitive names (Counter),
    kernel launches (names), host syncs."""
    scale = head_dim ** -0.5
    n = len(caches)
    # The step's inputs, made before timing (in a model they are the projections' lazy outputs).
    inputs = []
    for s in range(steps):
        row = []
        for i in range(n):
            key = (seed << 20) + (s << 8) + i
            row.append(tuple(_random(shape, dtype, 4 * key + j) for j, shape in enumerate(
                ((1, kv_heads, 1, head_dim), (1, kv_heads, 1, head_dim), (1, heads, 1, head_dim)))))
        mx.eval(row)
        inputs.append(row)
    records = []
    for s in range(steps):
        layer_records, outputs = [], []
        first_of_step = len(recorder.launches)
        for i, cache in enumerate(caches):
            k, v, q = inputs[s][i]
            with counting_syncs() as syncs:
                recorded = recorder.seconds
                t0 = time.perf_counter()
                keys, values = cache.update_and_fetch(k, v)
                out = attention(q, keys, values, cache=cache, scale=scale, mask=None)
                build_s = time.perf_counter() - t0 - (recorder.seconds - recorded)
            outputs.append([out, *state_arrays(cache)])
            layer_records.append({"build_s": build_s, "syncs": syncs[0]})
        # The recorder's nodes by id: each stands for the launch that made it.
        launched, evaluated = {}, []
        for label, out in recorder.launches[first_of_step:]:
            node = primitive_id(out)
            if node is None:  # evaluated inside the step (a host sync ran it)
                evaluated.append(label)
            else:
                launched[node] = label
        # Each node counts for the first layer reaching it: layer i's nodes are those of the
        # graph of layers 0..i less those of layers 0..i-1 (one export each: within one export
        # MLX visits each array once).
        reached = Counter()
        for i, record in enumerate(layer_records):
            upto = graph_counts([a for arrays in outputs[: i + 1] for a in arrays], launched)
            record["primitives"] = upto - reached
            reached = upto
        # Launches built but never reached (their output unused): no kernel would run.
        reached_ids = {i for i, _ in graph_nodes([a for arrays in outputs for a in arrays])}
        unreached = [label for i, label in launched.items() if i not in reached_ids]
        layer_records[0]["unreached_launches"] = unreached
        layer_records[0]["evaluated_launches"] = evaluated
        mx.eval([a for arrays in outputs for a in arrays])
        del recorder.launches[first_of_step:]
        records.append(layer_records)
    return records


def launches_of(primitives: Counter) -> int:
    return sum(c for name, c in primitives.items() if name not in VIEW_PRIMITIVES)


# ---- a method's census ----------------------------------------------------------------------
def census(method: str, model, *, history: int, steps: int | None, chunk: int, seed: int = 0,
           warmup_steps: int | None = None, stand_ins: bool = True) -> dict:
    """One method's decode-step census (see the module docstring). `stand_ins` False: the
    device's own path and kernels (on MLX's CUDA backend: the real launches, evaluated each
    step, and the real host time of building them; on the CPU: the portable path)."""
    heads, kv_heads, head_dim = (model.args.num_attention_heads, model.args.num_key_value_heads,
                                 model.args.head_dim)
    dtype = model.model.embed_tokens.weight.dtype
    shape = dict(kv_heads=kv_heads, heads=heads, head_dim=head_dim, dtype=dtype)
    with method_caches(method, model) as (caches, attention):
        prefill(caches, attention, history=history, chunk=chunk, seed=seed, **shape)
        block = getattr(caches[0], "block_size", 1)
        if steps is None:
            steps = max(DEFAULT_STEPS, block)
        if warmup_steps is None:
            warmup_steps = max(2, block)
        recorder = KernelRecorder()
        with cuda_path(recorder) if stand_ins else contextlib.nullcontext():
            # Warm-up, one block (a flush included): kernel factories, mx.compile traces of the
            # flush's shapes, placeholders, the dispatcher's link to each cache.
            decode_steps(caches, attention, steps=warmup_steps, seed=seed + 1, recorder=recorder, **shape)
            records = decode_steps(caches, attention, steps=steps, seed=seed + 2, recorder=recorder, **shape)
        kinds = [type(c).__name__ for c in caches]
    return summarize(method, records, kinds=kinds, block=block, history=history)


def summarize(method: str, records, *, kinds, block, history) -> dict:
    steps, n_layers = len(records), len(records[0])
    per_layer = []
    for i in range(n_layers):
        counts = [r[i]["primitives"] for r in records]
        total = sum(counts, Counter())
        per_layer.append({
            "cache": kinds[i],
            "primitives_per_step": _per_step(total, steps),
            "ops_per_step": sum(total.values()) / steps,
            "launches_per_step": launches_of(total) / steps,
            "typical_step": dict(sorted(_typical(counts).items())),
            "build_us_median": 1e6 * statistics.median(r[i]["build_s"] for r in records),
        })
    all_counts = sum((r[i]["primitives"] for r in records for i in range(n_layers)), Counter())
    builds = sorted(1e6 * r[i]["build_s"] for r in records for i in range(n_layers))
    quart = statistics.quantiles(builds, n=4) if len(builds) > 1 else [builds[0]] * 3
    return {
        "method": method,
        "history": history,
        "steps": steps,
        "block_size": block,
        "layers": per_layer,
        "per_layer_step": {
            "primitives": _per_step(all_counts, steps * n_layers),
            "ops": sum(all_counts.values()) / (steps * n_layers),
            "launches": launches_of(all_counts) / (steps * n_layers),
            "host_syncs": sum(r[i]["syncs"] for r in records for i in range(n_layers)) / (steps * n_layers),
            # Built but unreachable from anything the step keeps (no kernel would run): host time.
            "unreached_launches": sum(len(r[0]["unreached_launches"]) for r in records) / (steps * n_layers),
            # Launches whose outputs a sync inside the step already evaluated (not in `ops`).
            "evaluated_launches": sum(len(r[0]["evaluated_launches"]) for r in records) / (steps * n_layers),
            "build_us": {"median": quart[1], "p25": quart[0], "p75": quart[2],
                         "mean": statistics.fmean(builds)},
        },
    }


def _per_step(total: Counter, divisor: int) -> dict:
    return {name: round(c / divisor, 3) for name, c in sorted(total.items())}


def _typical(counts: list[Counter]) -> Counter:
    """The most common step's primitives (a step without a flush, for most methods)."""
    keyed = Counter(tuple(sorted(c.items())) for c in counts)
    return Counter(dict(keyed.most_common(1)[0][0]))


def with_ratios(results: dict) -> dict:
    """Adds, per method, its figures against fp16's (when fp16 was run)."""
    ref = results.get("fp16")
    if ref is None:
        return results
    base = ref["per_layer_step"]
    for r in results.values():
        own = r["per_layer_step"]
        r["vs_fp16"] = {
            "extra_ops": round(own["ops"] - base["ops"], 3),
            "extra_launches": round(own["launches"] - base["launches"], 3),
            "build_ratio": round(own["build_us"]["median"] / base["build_us"]["median"], 3),
            # The mean carries the flush steps' host time (a block's encode), the median not.
            "build_ratio_mean": round(own["build_us"]["mean"] / base["build_us"]["mean"], 3),
        }
    return results


def table(results: dict) -> str:
    """Markdown table: per layer and step (averaged over a block), and the typical step."""
    lines = [
        "| method | ops | launches | syncs | build us: median [p25, p75], mean | vs fp16 build (median, mean) | typical step (layer 0) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        s = r["per_layer_step"]
        b = s["build_us"]
        vs = r.get("vs_fp16", {})
        ratio = f"{vs['build_ratio']}, {vs['build_ratio_mean']}" if vs else ""
        typical = ", ".join(f"{k} x{v}" for k, v in r["layers"][0]["typical_step"].items())
        lines.append(f"| {name} | {s['ops']:.1f} | {s['launches']:.1f} | {s['host_syncs']:.2f} | "
                     f"{b['median']:.0f} [{b['p25']:.0f}, {b['p75']:.0f}], {b['mean']:.0f} | {ratio} | {typical} |")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------
def method_list(text: str) -> list[str]:
    """A comma list of METHODS and marked ablations (`kivi-compiled`, `gear-inplace`, ...), each
    with fields as gpu_speed takes them (`minicache:minicache_start_fraction=0.0`) -> the names
    (chunk_census reads its --methods the same way); ValueError naming the unknown ones and
    what is allowed, or the invalid fields."""
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec
    from veloxquant_mlx.cli.bench import _split_top
    from veloxquant_mlx.errors import QuantizerConfigError

    methods = _split_top(text)
    marked = marked_ablations()
    unknown = [m for m in methods if m.partition(":")[0] not in (*METHODS, *marked)]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}: allowed are {', '.join(METHODS)}, or a method's "
                         "ablation that sets its caches' attributes (bench/ablations.py: "
                         f"{', '.join(sorted(marked))}), each optionally with fields (method:field=value,...)")
    for method in methods:
        try:
            parse_layer_spec(method)  # the fields checked against the method's config
        except QuantizerConfigError as exc:
            raise ValueError(str(exc)) from None
    return methods


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.step_census", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--layers", type=int, default=4, help="attention layers (default 4: two pairs)")
    p.add_argument("--history", type=int, default=4096, help="tokens cached before the steps")
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed steps (default {DEFAULT_STEPS}, or the block size if larger)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="untimed steps first (default: one block of the method, at least 2)")
    p.add_argument("--stand-ins", choices=("auto", "on", "off"), default="auto",
                   help="record kernels and take CUDA's branches on this device (on), or run the "
                        "device's own path (off; on MLX's CUDA backend: the real kernels and "
                        "host times); auto: off on CUDA, else on")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(args) -> dict:
    from veloxquant_mlx.bench.tiny import random_llama

    try:
        methods = method_list(args.methods)
    except ValueError as exc:
        raise SystemExit(f"step_census: {exc}") from None
    if "fp16" in methods:  # the reference first
        methods = ["fp16", *[m for m in methods if m != "fp16"]]
    from veloxquant_mlx.cache.fused_decode import _on_cuda

    stand_ins = {"on": True, "off": False, "auto": not _on_cuda()}[args.stand_ins]
    model = random_llama(hidden=256, layers=args.layers, intermediate=64, vocab=64,
                         dtype=getattr(mx, args.dtype), seed=args.seed, **LLAMA_8B_ATTENTION)
    results = {}
    for method in methods:
        t0 = time.perf_counter()
        results[method] = census(method, model, history=args.history, steps=args.steps,
                                 chunk=args.chunk, seed=args.seed, warmup_steps=args.warmup_steps,
                                 stand_ins=stand_ins)
        print(f"[step_census] {method}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return {
        "machine": f"{platform.node()} {platform.machine()} ({mx.default_device()})",
        "stand_ins": stand_ins,  # True: CUDA's path taken on this device, kernels recorded
        "mlx": mx.__version__,
        "shape": {**LLAMA_8B_ATTENTION, "layers": args.layers, "dtype": args.dtype,
                  "history": args.history},
        "methods": with_ratios(results),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(table(result["methods"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
