"""A launch plan's compiled decode step replayed without its per-step bookkeeping.

Why: on a host-bound H200 a decode step of ours waits on the Python each layer runs before its
launch. Once a launch plan's first compiled step has run (fused_decode.planned_attend), every
later step of the plan launches the same traced function on the same arrays but five: the
queries, the window's keys and values and its filled rows, and the previous launch's output it
follows. Rebuilding the input list, the window's inputs, the merge's scratch and counters and
the launch's key through PartialsKernel.attend and CompiledLaunch.__call__ took ~3.8 us per
layer and step on this machine's CPU (kivi, pinned); swapping the slots takes a fraction. The
step census, paired (results/step_census_cpu_s37_replay_*.json): 3.9-5.2 us less per layer
and step in the six kernel methods, kivi 25.5 -> 20.9 against fp16's 10.6.

What it checks at each step, falling back to the full path (None) where anything moved: the
same kernel object (a factory emptied or a constant set between steps builds another), the
same FusedLaunchState, its compiled function and its counters and scratch, and the window's
buffers in the plan's dtype. What the caller checks: the plan is this step's (its key covers the
store, history, queries' shape and dtype, scale, window in place), the launch is the compiled
fused one (no constants in the source, no text as written, MERGE_IN_KERNEL).
"""

from __future__ import annotations

from veloxquant_mlx.cache.compiled_launch import window_count


class ReplayStep:
    """The arrays of a plan's compiled launch, its own in place (the store, meta, exact sink,
    counters, scratch) and the step's slots empty: [inputs..., counts, scratch, after], as
    PartialsKernel.attend hands them to the state's CompiledLaunch."""

    def __init__(self, plan, kernel, state, plan_inputs: list, slots: tuple, dtype):
        self.plan, self.kernel, self.state, self.dtype = plan, kernel, state, dtype
        self.function = state.compiled.function
        self.keys_slot, self.values_slot, self.rows_slot = slots
        # The plan's inputs hold None in the step's slots; the queries' slot is 0, `after` last.
        self.arrays = [*plan_inputs, state.counts, state.scratch, None]
        self.counts_slot = len(plan_inputs)

    def run(self, kernel, state, queries, held):
        """The step's attention output, or None where the full path must run. `held`:
        window_buffer.held(cache), the in-place window with its rows and dtypes."""
        arrays = self.arrays
        if (kernel is not self.kernel or state is not self.state or state.compiled.function is not self.function
                or state.counts is not arrays[self.counts_slot] or state.scratch is not arrays[self.counts_slot + 1]
                or held is None or held[6] != self.dtype or held[7] != self.dtype):
            return None
        arrays = arrays.copy()
        arrays[0] = queries
        arrays[self.keys_slot], arrays[self.values_slot] = held[0], held[1]
        arrays[self.rows_slot] = window_count(held[4])
        arrays[-1] = state.after(queries)
        out = state.compiled.replay(arrays)
        state.last_out = out
        return out
