"""bench.launch_cost off CUDA: its built-in ops' cases run, and its decode-shaped kernel call has
the counts it names (the CUDA cases run on the H200 only)."""
import mlx.core as mx

from veloxquant_mlx.bench import launch_cost


def test_the_decode_shaped_call_has_a_decode_launchs_counts():
    names = [name for name, _ in launch_cost.DECODE_TEMPLATE]
    assert len(names) == 27 and len(set(names)) == 27
    assert launch_cost.DECODE_INPUTS == 24


def test_the_padded_source_has_the_size_asked_and_ends_in_the_kernel():
    source = launch_cost._padded_source(launch_cost.DECODE_SOURCE_BYTES)
    assert len(source) == launch_cost.DECODE_SOURCE_BYTES
    assert source.startswith("// ") and source.endswith(launch_cost._SOURCE)
    assert source.count("\n") == 1  # one comment line, then the kernel


def test_the_compact_case_has_gears_decode_source_at_its_compacted_size():
    # GEAR's fused decode source is ~41 KB as written; compacted, ~22 KB (session 36).
    assert 15_000 < launch_cost._compact_decode_source_bytes() < 0.67 * launch_cost.DECODE_SOURCE_BYTES


def test_the_builtin_cases_time_every_call(monkeypatch):
    monkeypatch.setattr(launch_cost, "CALLS", 20)
    cases = launch_cost.run()
    assert set(cases) == {"add", "add_compiled", "concatenate_24_inputs", "concatenate_24_inputs_compiled", "concatenate",
                          "window_write", "meta_from_list"}
    for case in cases.values():
        assert case["build_us"] > 0 and case["eval_us"] >= 0
        assert case["build_us_range"][0] <= case["build_us"] <= case["build_us_range"][1]


def test_a_compiled_call_gives_the_plain_calls_result():
    a, b = mx.array([1.0, 2.0]), mx.array([3.0, 5.0])
    plain, compiled = launch_cost._bound(mx.add, [a, b], False), launch_cost._bound(mx.add, [a, b], True)
    assert compiled().tolist() == plain().tolist() == [4.0, 7.0]
