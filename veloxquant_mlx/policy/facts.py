"""The facts a policy decides on: the workload's fields, derived ones and the hardware's.

Every fact has a declared domain. The evaluator reads facts from a plain dict; lint and
simulate read the domains to cut the fact space into bands and to build concrete witnesses.

Null facts: `total_memory_bytes` is null when the total is unknown (a HardwareInfo total of
None or 0), and `pressure_fraction` is null then too. A comparison against a null fact is
false, always (so `not` over such a comparison is true): a rule about memory pressure simply
does not fire when the pressure is unknown.
"""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx.config.hardware import HardwareInfo
from veloxquant_mlx.config.workload import WorkloadSpec


@dataclass(frozen=True)
class FactSpec:
    name: str
    kind: str  # "int" or "float": integers are banded on the integer lattice, floats on reals
    minimum: float  # smallest value in the domain (inclusive)
    nullable: bool = False
    power_of_two: bool = False
    derived: bool = False
    sample: float = 1  # a typical value, used to check a reason template's format spec
    description: str = ""


FACTS: dict[str, FactSpec] = {
    spec.name: spec
    for spec in (
        FactSpec("head_dim", "int", 1, power_of_two=True, sample=128,
                 description="dimension of one attention head (a power of 2)"),
        FactSpec("seq_len", "int", 1, sample=4096, description="tokens held in the cache"),
        FactSpec("n_layers", "int", 1, sample=32, description="attention layers"),
        FactSpec("batch_size", "int", 1, sample=1, description="sequences per batch"),
        FactSpec("fp16_kv_bytes", "int", 4, derived=True, sample=2**30,
                 description="bytes of an fp16 KV cache: 2 * batch * layers * seq_len * head_dim * 2"),
        FactSpec("total_memory_bytes", "int", 1, nullable=True, sample=2**35,
                 description="device memory in bytes; null when unknown"),
        FactSpec("active_memory_bytes", "int", 0, sample=2**32,
                 description="memory in use before the cache is built"),
        FactSpec("pressure_fraction", "float", 0.0, nullable=True, derived=True, sample=0.5,
                 description="(active + fp16_kv_bytes) / total; null when the total is unknown"),
    )
}

FACT_NAMES = tuple(FACTS)


def facts_of(workload: WorkloadSpec, hardware: HardwareInfo) -> dict:
    """The fact dict of one workload on one machine (plain values, JSON-safe)."""
    fp16 = workload.fp16_kv_bytes()
    total = hardware.total_memory_bytes or None
    return {
        "head_dim": workload.head_dim,
        "seq_len": workload.seq_len,
        "n_layers": workload.n_layers,
        "batch_size": workload.batch_size,
        "fp16_kv_bytes": fp16,
        "total_memory_bytes": total,
        "active_memory_bytes": hardware.active_memory_bytes,
        "pressure_fraction": hardware.pressure_fraction(fp16),
    }
