"""GEARCache's prefill K/V (compiled, fixed-size pieces) against the decode it replaced: bit for bit."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.gear_encoder import dequantize
from veloxquant_mlx.cache.gear_outliers import add_block_entries, block_positions, densify


def reference_decode_float32(cache: GEARCache):
    """GEARCache.decode_float32 as of main 68a76e1 (the one-graph decode of the whole history),
    frozen here so that a change to the shared decode_side cannot move both sides at once."""
    n, g, st = cache.n_compressed, cache.code_group, cache.store
    B, H, D = cache.batch_size, cache.n_kv_heads, cache.head_dim
    k_codes = st["k_codes"][:, :, :, : n // 32].reshape(B, H, D, n * cache.code_bits // 32)
    deq = lambda c, s, z: dequantize(c, s, z, g, cache.code_bits)  # noqa: E731
    keys = deq(k_codes, st["k_scales"][..., : n // g], st["k_zeros"][..., : n // g])
    values = deq(st["v_codes"][:, :, :n], st["v_scales"][:, :, :n], st["v_zeros"][:, :, :n])

    def add_residual(s, x):
        B, H, _, d = x.shape
        n_blocks = n // cache.block_tokens
        if cache.rank:
            tokens = st[f"{s}_lr_tokens"][:, :, :n].reshape(B, H, n_blocks, cache.block_tokens, cache.rank)
            channels = st[f"{s}_lr_channels"][:, :, :n_blocks]
            low = tokens.astype(mx.float32) @ channels.astype(mx.float32).swapaxes(-1, -2)
            x = x + low.reshape(B, H, n, d)
        if f"{s}_out_values" in st:
            token, channel = block_positions(st[f"{s}_out_index"][:, :, :n_blocks], cache.block_tokens, d)
            vals = st[f"{s}_out_values"][:, :, :n_blocks].reshape(B, H, -1)
            x = x + densify(token, channel, vals, n, d, mx.float32)
        return x

    return add_residual("k", keys.swapaxes(-1, -2)), add_residual("v", values)


def reference_prefill_keys_values(cache: GEARCache, queries: mx.array):
    """What the base class's path built from the frozen decode: history then window, cast."""
    keys, values = (x.astype(cache.dtype) for x in reference_decode_float32(cache))
    if cache.window_keys is not None:
        keys = mx.concatenate([keys, cache.window_keys], axis=2)
        values = mx.concatenate([values, cache.window_values], axis=2)
    return keys.astype(queries.dtype), values.astype(queries.dtype)


def bits(x: mx.array) -> mx.array:
    return x.view({2: mx.uint16, 4: mx.uint32}[x.dtype.size])


def filled_cache(heads, dim, dtype, rank, fraction, chunks, seed=0):
    cache = GEARCache(KVCacheConfig(method="gear", gear_bits=2, gear_rank=rank, gear_outlier_fraction=fraction))
    key = mx.random.key(seed)
    for n in chunks:
        key, k1, k2 = mx.random.split(key, 3)
        # Heavy-tailed, with a channel offset: outliers and low-rank structure to keep.
        keys = (mx.random.normal((1, heads, n, dim), key=k1) ** 3 + mx.arange(dim) / dim).astype(dtype)
        values = mx.random.laplace((1, heads, n, dim), key=k2).astype(dtype)
        cache.update_and_fetch(keys, values)
        cache._flush()
        mx.eval(cache.store, cache.window_keys, cache.window_values)
    return cache


CASES = [
    # heads, dim, cache dtype, rank, outlier fraction
    (2, 128, mx.bfloat16, 4, 0.01),
    (2, 128, mx.float32, 4, 0.01),
    (3, 64, mx.float16, 4, 0.01),
    (2, 64, mx.bfloat16, 0, 0.01),
    (2, 64, mx.float32, 4, 0.0),
    (2, 64, mx.bfloat16, 0, 0.0),
]


@pytest.mark.parametrize("heads,dim,dtype,rank,fraction", CASES)
@pytest.mark.parametrize("piece_blocks,synced", [(1, False), (2, True), (2, False), (8, False)])
def test_prefill_keys_values_are_bit_identical_to_the_whole_history_decode(
    monkeypatch, heads, dim, dtype, rank, fraction, piece_blocks, synced
):
    # 5 blocks of history + a window of 100 tokens; pieces of 1, 2 (a remainder of 1) or 8
    # blocks (one piece longer than the history); ordered in the graph (the default) or with
    # session 5's evaluation per piece (gear.PREFILL_HOST_SYNCS).
    from veloxquant_mlx.cache import gear

    monkeypatch.setattr(gear, "PREFILL_HOST_SYNCS", synced)
    cache = filled_cache(heads, dim, dtype, rank, fraction, [1024, 256, 100])
    assert cache.n_compressed == 1280 and cache._window_length() == 100
    cache.prefill_decode_bytes = heads * dim * 4 * cache.block_tokens * piece_blocks
    cache.prefill_unsynced_bytes = 0 if synced else 1 << 40
    assert cache._prefill_piece_tokens() == piece_blocks * cache.block_tokens
    queries = mx.random.normal((1, 2 * heads, 16, dim)).astype(dtype)
    keys, values = cache._prefill_keys_values(queries)
    for label, expected in (
        ("frozen decode", reference_prefill_keys_values(cache, queries)),
        ("base path", CompressedKVCache._prefill_keys_values(cache, queries)),
    ):
        assert keys.dtype == expected[0].dtype == dtype and keys.shape == expected[0].shape, label
        assert mx.array_equal(bits(keys), bits(expected[0])).item(), label
        assert mx.array_equal(bits(values), bits(expected[1])).item(), label


def test_prefill_in_another_dtype_than_the_cache_rounds_to_the_cache_dtype_first():
    cache = filled_cache(2, 64, mx.float16, 4, 0.01, [512, 40])
    cache.prefill_decode_bytes = 2 * 64 * 4 * 256
    queries = mx.random.normal((1, 4, 16, 64))  # float32 queries over a float16 cache
    keys, values = cache._prefill_keys_values(queries)
    expected = reference_prefill_keys_values(cache, queries)
    assert keys.dtype == mx.float32
    assert mx.array_equal(bits(keys), bits(expected[0])).item()
    assert mx.array_equal(bits(values), bits(expected[1])).item()


def test_prefill_without_a_window_and_the_decode_float32_are_unchanged():
    cache = filled_cache(2, 64, mx.bfloat16, 4, 0.01, [512])
    assert cache.window_keys is None
    queries = mx.random.normal((1, 2, 16, 64)).astype(mx.bfloat16)
    keys, values = cache._prefill_keys_values(queries)
    expected = reference_prefill_keys_values(cache, queries)
    assert mx.array_equal(bits(keys), bits(expected[0])).item()
    assert mx.array_equal(bits(values), bits(expected[1])).item()
    for got, want in zip(cache.decode_float32(), reference_decode_float32(cache)):
        assert mx.array_equal(bits(got), bits(want)).item()


def test_add_block_entries_is_the_dense_sum_bit_for_bit_signed_zeros_included():
    # The decode adds the sparse part in place (add_block_entries) where it used to add a dense
    # array: x + densify(...). Signed zeros are where the two could differ: x + 0.0 turns -0.0
    # into +0.0 (a dequantized entry can be -0.0, mx.quantize's scales may be negative).
    B, H, nb, n_blocks, d, k = 2, 3, 4, 3, 5, 6
    x = mx.random.normal((B, H, n_blocks * nb, d))
    zeros = mx.random.randint(0, 3, x.shape)
    x = mx.where(zeros == 0, -0.0, mx.where(zeros == 1, 0.0, x))
    index = mx.stack([mx.random.permutation(nb * d)[:k] for _ in range(B * H * n_blocks)]).reshape(B, H, n_blocks, k)
    values = mx.array([-0.0, 0.0, 1.5, -2.0, 3e-39, -7.0] * (B * H * n_blocks)).reshape(B, H, n_blocks, k)
    ours = add_block_entries(x, index.astype(mx.uint16), values.astype(mx.float16), nb)
    token, channel = block_positions(index, nb, d)
    dense = x + densify(token, channel, values.astype(mx.float16).reshape(B, H, -1), n_blocks * nb, d, mx.float32)
    assert (x.view(mx.uint32) == 0x80000000).sum().item() > 0
    assert mx.array_equal(ours.view(mx.uint32), dense.view(mx.uint32)).item()


def test_a_prefill_through_attention_matches_the_base_path():
    # The whole chunk's attention (what a patched model runs) with and without the override.
    cache = filled_cache(2, 64, mx.float32, 4, 0.01, [768, 30])
    cache.prefill_decode_bytes = 2 * 64 * 4 * 256
    rows = 32
    keys = mx.random.normal((1, 2, rows, 64))
    cache.update_and_fetch(keys, keys)
    queries = mx.random.normal((1, 4, rows, 64))
    ours = cache._attend_prefill(queries, 0.125, "causal")
    k, v = CompressedKVCache._prefill_keys_values(cache, queries)
    base = mx.fast.scaled_dot_product_attention(queries, k, v, scale=0.125, mask="causal")
    assert mx.array_equal(ours, base).item()


def test_smaller_blocks_decode_the_same_in_pieces():
    # bench/ablations.py's 64-token blocks: pieces of two blocks (128 tokens) over 1024 tokens.
    from veloxquant_mlx.bench.ablations import SmallBlockGEAR

    cache = SmallBlockGEAR(KVCacheConfig(method="gear", gear_bits=2, gear_rank=4, gear_outlier_fraction=0.01))
    for n in (700, 300, 50):
        x = mx.random.normal((1, 2, n, 64))
        cache.update_and_fetch(x, 2 * x)
        cache._flush()
    cache.prefill_decode_bytes = 2 * 64 * 4 * 128
    cache.prefill_unsynced_bytes = 0
    assert cache._prefill_piece_tokens() == 128 and cache.n_compressed == 1024
    queries = mx.random.normal((1, 2, 16, 64))
    keys, values = cache._prefill_keys_values(queries)
    expected = reference_prefill_keys_values(cache, queries)
    assert mx.array_equal(bits(keys), bits(expected[0])).item()
    assert mx.array_equal(bits(values), bits(expected[1])).item()


def test_a_patched_model_generates_the_same_tokens_with_synced_pieces(monkeypatch):
    # mlx-lm's own prefill (chunks of 128 over a 900-token prompt) through the patched
    # attention: pieces of one block, ordered in the graph (the default) and evaluated one by
    # one (session 5's host syncs), against one piece per history.
    from tests.integration.tiny_llama import greedy_tokens, tiny_llama
    from veloxquant_mlx import patch_model_kv_cache, unpatch_model_kv_cache
    from veloxquant_mlx.cache import gear

    model = tiny_llama()
    prompt = mx.array([(i * 7) % 64 for i in range(900)])
    config = KVCacheConfig(method="gear", gear_bits=2)
    try:
        patch_model_kv_cache(model, config)
        whole = greedy_tokens(model, prompt=prompt, n=6)
        monkeypatch.setattr(GEARCache, "prefill_decode_bytes", 1)  # one block per piece
        assert greedy_tokens(model, prompt=prompt, n=6) == whole
        monkeypatch.setattr(GEARCache, "prefill_unsynced_bytes", 0)
        monkeypatch.setattr(gear, "PREFILL_HOST_SYNCS", True)
        assert greedy_tokens(model, prompt=prompt, n=6) == whole
    finally:
        unpatch_model_kv_cache(model)


def test_the_uncompiled_pieces_are_the_same_bits(monkeypatch):
    # COMPILE_PREFILL_DECODE = False is the fallback should the compiled pieces differ on a GPU.
    from veloxquant_mlx.cache import gear

    monkeypatch.setattr(gear, "COMPILE_PREFILL_DECODE", False)
    gear.compiled_decoder.cache_clear()
    try:
        cache = filled_cache(2, 64, mx.bfloat16, 4, 0.01, [768, 30])
        cache.prefill_decode_bytes = 2 * 64 * 4 * 512
        queries = mx.random.normal((1, 4, 16, 64)).astype(mx.bfloat16)
        keys, values = cache._prefill_keys_values(queries)
        expected = reference_prefill_keys_values(cache, queries)
        assert mx.array_equal(bits(keys), bits(expected[0])).item()
        assert mx.array_equal(bits(values), bits(expected[1])).item()
    finally:
        gear.compiled_decoder.cache_clear()


def _ancestry_graph(*arrays):
    """(labels {node: primitive}, parents {node: set of nodes}) of the lazy graph reaching
    `arrays`, from mx.export_to_dot: primitives and arrays are both nodes, edges point from an
    input to its consumer."""
    import io
    import re

    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    text = dot.getvalue()
    labels = dict(re.findall(r'(\w+) \[label ?= ?"([^"]+)"', text))
    parents: dict = {}
    for src, dst in re.findall(r'"?(\w+)"? -> "?(\w+)"?', text):
        parents.setdefault(dst, set()).add(src)
    return labels, parents


def _ancestors(node, parents) -> set:
    seen, stack = set(), [node]
    while stack:
        for p in parents.get(stack.pop(), ()):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


@pytest.mark.parametrize("rank,fraction", [(4, 0.01), (0, 0.0)])
def test_without_host_syncs_every_op_of_the_decode_waits_for_the_queries(rank, fraction):
    # What the host syncs ordered (session 5), the graph orders now (gear._prefill_order): every
    # primitive that computes or allocates (views aside), the result's zeros included, has the
    # queries among its ancestors, so MLX cannot run (or allocate) any of this layer's history
    # before the model up to this layer. The queries here end in an Exp to find them.
    cache = filled_cache(2, 64, mx.bfloat16, rank, fraction, [768, 30])
    cache.prefill_decode_bytes = 2 * 64 * 4 * 256  # three pieces
    raw = mx.random.normal((1, 4, 16, 64))
    mx.eval(raw)
    queries = mx.exp(raw).astype(mx.bfloat16)
    keys, values = cache._prefill_keys_values(queries)
    labels, parents = _ancestry_graph(keys, values)
    (exp,) = [n for n, label in labels.items() if label == "Exp"]
    own = _ancestors(exp, parents) | {exp}
    views = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided", "Depends"}

    def index_constant(node):
        # The sparse part's block offsets (mx.arange over the blocks times the block's entries:
        # B * H * n_blocks int32, made from nothing) cannot wait without an input to wait on;
        # they are exempt.
        family = _ancestors(node, parents) | {node}
        return any(labels.get(a) == "Arange" for a in family) and not any(labels.get(a) == "Depends" for a in family)

    checked = [n for n, label in labels.items() if label not in views and n not in own and not index_constant(n)]
    late = [labels[n] for n in checked if exp not in _ancestors(n, parents)]
    assert {"Full", "SliceUpdate"} <= {labels[n] for n in checked} and late == [], late
    # And the pieces one after the other: every mx.depends (a side's zeros and each piece) but the
    # first two (the keys' zeros and first piece, which wait for the queries only) waits for the
    # result as filled so far.
    depends = [n for n, label in labels.items() if label == "Depends"]
    first = [n for n in depends if not any(labels.get(a) == "SliceUpdate" for a in _ancestors(n, parents))]
    assert len(depends) == 2 * (1 + 3) and len(first) == 2, (len(depends), len(first))  # 3 pieces a side
    # The same graph gives the same bits as the frozen decode.
    expected = reference_prefill_keys_values(cache, queries)
    assert mx.array_equal(bits(keys), bits(expected[0])).item()
    assert mx.array_equal(bits(values), bits(expected[1])).item()
