"""WorkloadSpec: what a user runs, in the four numbers the policy decides on."""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx.errors import QuantizerConfigError


def _require_positive_int(field: str, value: object) -> None:
    # bool is an int subclass; True as a layer count is a bug in the caller, not a 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise QuantizerConfigError(
            f"WorkloadSpec.{field}={value!r} is invalid: allowed is an integer >= 1"
        )


@dataclass(frozen=True)
class WorkloadSpec:
    head_dim: int = 128
    seq_len: int = 4096
    n_layers: int = 1
    batch_size: int = 1

    def __post_init__(self) -> None:
        _require_positive_int("head_dim", self.head_dim)
        if self.head_dim & (self.head_dim - 1):
            raise QuantizerConfigError(
                f"WorkloadSpec.head_dim={self.head_dim!r} is invalid: allowed is a positive "
                "power of 2 (1, 2, 4, ..., 64, 128, 256, ...)"
            )
        for field in ("seq_len", "n_layers", "batch_size"):
            _require_positive_int(field, getattr(self, field))

    def fp16_kv_bytes(self) -> int:
        """Bytes an fp16 KV cache needs: keys and values, 2 bytes each element."""
        return 2 * self.batch_size * self.n_layers * self.seq_len * self.head_dim * 2

    @classmethod
    def from_model(cls, model, seq_len: int, batch_size: int = 1) -> "WorkloadSpec":
        """Read head_dim and the attention layer count from a loaded mlx-lm / mlx-vlm model."""
        from veloxquant_mlx.config.model_shape import read_model_shape

        head_dim, n_layers = read_model_shape(model)
        return cls(head_dim=head_dim, seq_len=seq_len, n_layers=n_layers, batch_size=batch_size)
