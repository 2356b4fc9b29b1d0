"""Spy on a cache class: how many query rows each attention call had, and which of them
decoded the compressed history. Prefill chunks (>= prefill_rows queries) may decode it once;
a decode step must not."""


def spy_history_decodes(monkeypatch, cache_class):
    step_rows, decodes = [], []
    original_decode, original_attention = cache_class._decode, cache_class.attention

    def spy_attention(self, queries, *args, **kwargs):
        step_rows.append(queries.shape[2])
        return original_attention(self, queries, *args, **kwargs)

    def spy_decode(self):
        decodes.append(step_rows[-1] if step_rows else None)
        return original_decode(self)

    monkeypatch.setattr(cache_class, "attention", spy_attention)
    monkeypatch.setattr(cache_class, "_decode", spy_decode)
    return step_rows, decodes


def assert_decode_steps_never_decoded(step_rows, decodes, cache_class, min_steps: int) -> None:
    assert step_rows.count(1) >= min_steps, "the decode steps did not go through our attention"
    assert all(rows is not None and rows >= cache_class.prefill_rows for rows in decodes), (
        f"the history was decoded during a decode step: rows per decode {decodes}"
    )
