"""A test double: a CompressedKVCache whose "encoding" keeps the block exactly. It exercises
the base's window, flush, capacity, mask, trim and state logic against plain attention, so a
failure here is the base's, not a method's."""

from veloxquant_mlx.cache.base import CompressedKVCache, StoreArray


class ExactStoreCache(CompressedKVCache):
    method = "kivi"  # any registered method name; the config is only carried along
    step = 64

    @property
    def block_size(self):
        return 16

    @property
    def residual_length(self):
        return 8

    def _store_layout(self):
        return [
            StoreArray("k", axis=2, tokens_per_index=1, dtype=self.dtype, trailing=(-1, self.head_dim)),
            StoreArray("v", axis=2, tokens_per_index=1, dtype=self.dtype, trailing=(-1, self.value_dim)),
        ]

    def _encode(self, keys, values):
        return {"k": keys, "v": values}

    def _decode(self):
        n = self.n_compressed
        return self.store["k"][:, :, :n], self.store["v"][:, :, :n]

    def _scores(self, q):
        return q @ self.store["k"].swapaxes(-1, -2)

    def _weighted_values(self, p):
        return p @ self.store["v"]

    def bits_per_element(self):
        return 16.0
