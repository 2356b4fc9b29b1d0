"""A store write that needs more capacity grows and writes in one concatenation
(base.GROW_WITH_WRITE, `_grow_with`): the stored history, the capacity and what attention
reads are those of growing first and writing in place, for every store layout."""

from collections import Counter

import mlx.core as mx
import pytest

from veloxquant_mlx.bench.layer_specs import parse_layer_spec
from veloxquant_mlx.bench.step_census import graph_nodes
from veloxquant_mlx.cache import base

# One spec per store layout (kivi's affine codes with its sink, turboquant_rvq's rotated codes,
# kvquant's blocks with per-token and per-block arrays and uint16 outliers, gear's low rank).
SPECS = ("kivi", "turboquant_rvq", "kvquant", "gear")
H, D = 2, 64


def _run(spec_name: str, grow_with_write: bool, monkeypatch):
    """Prompt chunks (one past a growth step, one of whole steps), a trim into the history,
    then single-token steps across a growth: -> (cache, attention outputs of every step)."""
    monkeypatch.setattr(base, "GROW_WITH_WRITE", grow_with_write)
    cache = parse_layer_spec(spec_name).make()
    k = mx.random.normal((1, H, 1200, D), key=mx.random.key(1))
    v = mx.random.normal((1, H, 1200, D), key=mx.random.key(2))
    q = mx.random.normal((1, 2 * H, 1200, D), key=mx.random.key(3))
    outs = []
    for a, b in ((0, 300), (300, 812)):
        cache.update_and_fetch(k[:, :, a:b], v[:, :, a:b])
        outs.append(cache.attention(q[:, :, a:b], scale=D**-0.5, mask="causal"))
        mx.eval(outs[-1])
    cache.trim(150)
    for t in range(662, 1000):
        cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(cache.attention(q[:, :, t : t + 1], scale=D**-0.5))
        mx.eval(outs[-1])
    return cache, outs


def _filled(cache, spec) -> mx.array:
    array = cache.store[spec.name]
    index = [slice(None)] * array.ndim
    index[spec.axis % array.ndim] = slice(0, cache.n_compressed // spec.tokens_per_index)
    return array[tuple(index)]


def _assert_same_history(ours, ours_outs, theirs, theirs_outs) -> None:
    """The same capacity, stored history (up to n_compressed) and attention outputs."""
    assert ours.capacity == theirs.capacity and ours.n_compressed == theirs.n_compressed > 0
    for spec in ours._store_layout():
        a, b = ours.store[spec.name], theirs.store[spec.name]
        assert a.shape == b.shape and a.dtype == b.dtype, spec.name
        assert mx.array_equal(_filled(ours, spec), _filled(theirs, spec)).item(), spec.name
    assert len(ours_outs) == len(theirs_outs)
    for i, (x, y) in enumerate(zip(ours_outs, theirs_outs)):
        assert mx.array_equal(x, y).item(), f"step {i}"


@pytest.mark.parametrize("spec_name", SPECS)
def test_growing_with_the_write_stores_and_reads_what_growing_then_writing_does(spec_name, monkeypatch):
    _assert_same_history(*_run(spec_name, True, monkeypatch), *_run(spec_name, False, monkeypatch))


def _store_graph_after_three_chunks(grow_with_write: bool, monkeypatch) -> tuple[int, Counter]:
    """(store arrays, primitives of kvquant's store arrays' unevaluated graph after the third 512-token prompt
    chunk (each chunk's blocks end at the grown capacity: no slack))."""
    monkeypatch.setattr(base, "GROW_WITH_WRITE", grow_with_write)
    cache = parse_layer_spec("kvquant").make()
    k = mx.random.normal((1, H, 1536, D), key=mx.random.key(4))
    mx.eval(k)
    for a in (0, 512, 1024):
        mx.eval(list(cache.store.values()))
        cache.update_and_fetch(k[:, :, a : a + 512], k[:, :, a : a + 512])
        cache.attention(k[:, :, a : a + 512], scale=0.1, mask="causal")
    assert cache.capacity == cache.n_compressed == 1536
    layout = cache._store_layout()
    return len(layout), Counter(name for _, name in graph_nodes([cache.store[s.name] for s in layout]))


def test_a_prompt_chunk_ending_at_the_new_capacity_grows_without_zero_fill_or_slice_write(monkeypatch):
    # What the change buys: per store array no zero fill of the growth and no separate write
    # (each a kernel launch on CUDA); the concatenation itself stays one per array.
    arrays, grown = _store_graph_after_three_chunks(True, monkeypatch)
    _, written = _store_graph_after_three_chunks(False, monkeypatch)
    assert written["SliceUpdate"] == arrays and grown["SliceUpdate"] == 0
    assert written["Full"] - grown["Full"] == arrays
    assert grown["Concatenate"] == written["Concatenate"]


def _run_with_slack_fill(spec_name: str, from_write: bool, monkeypatch):
    monkeypatch.setattr(base, "SLACK_FROM_WRITE", from_write)
    return _run(spec_name, True, monkeypatch)


@pytest.mark.parametrize("spec_name", SPECS)
def test_slack_filled_from_the_write_stores_and_reads_what_zero_slack_does(spec_name, monkeypatch):
    # The 300-token chunk ends its blocks inside a 256-token tile (kivi and turboquant_rvq keep
    # an exact residual too): the growth has slack, filled from the written blocks or with zeros.
    _assert_same_history(*_run_with_slack_fill(spec_name, True, monkeypatch),
                         *_run_with_slack_fill(spec_name, False, monkeypatch))


def test_a_growth_with_slack_needs_no_zero_fill(monkeypatch):
    """turboquant_rvq keeps 64 exact tokens: a prompt chunk after the first ends its blocks 64
    tokens short of a tile, so its growth has slack; filled from the write, no Full node (a zero
    fill launch on CUDA) is left in the store arrays' graph."""
    counts = {}
    for from_write in (True, False):
        monkeypatch.setattr(base, "SLACK_FROM_WRITE", from_write)
        cache = parse_layer_spec("turboquant_rvq").make()
        k = mx.random.normal((1, H, 2048, D), key=mx.random.key(5))
        mx.eval(k)
        for a in (0, 1024):  # the first chunk's store is made, the second's grows it
            mx.eval(list(cache.store.values()))
            cache.update_and_fetch(k[:, :, a : a + 1024], k[:, :, a : a + 1024])
            cache._flush()
        assert cache.n_compressed == 2048 - 64 and cache.capacity == 2048
        layout = cache._store_layout()
        counts[from_write] = Counter(name for _, name in graph_nodes([cache.store[s.name] for s in layout]))
    assert counts[True]["Full"] == 0 and counts[False]["Full"] == len(layout)
    # One concatenation per store array either way (the encoder makes a few of its own).
    assert counts[True]["Concatenate"] == counts[False]["Concatenate"] >= len(layout)
