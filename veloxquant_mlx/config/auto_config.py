"""select_kv_cache_config: a workload (and the machine) through the policy to a KVCacheConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from veloxquant_mlx.config.hardware import HardwareInfo, detect_hardware_info
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.config.workload import WorkloadSpec
from veloxquant_mlx.errors import QuantizerConfigError
from veloxquant_mlx.policy.evaluator import decide
from veloxquant_mlx.policy.facts import facts_of
from veloxquant_mlx.policy.sources import resolve_policy


@dataclass(frozen=True)
class AutoConfigResult:
    """The chosen config and one sentence naming the policy version and rule. `decision` holds
    the full trail (every rule tried, the facts each saw, the adjustments applied)."""

    config: KVCacheConfig
    reason: str
    decision: object = field(default=None, compare=False, repr=False)

    @property
    def trail(self):
        return self.decision


def select_kv_cache_config(workload: WorkloadSpec, hardware: HardwareInfo | None = None, *,
                           policy=None) -> AutoConfigResult:
    """Choose a KV-cache config for a workload. hardware None means detect_hardware_info().
    policy: None (VELOXQUANT_POLICY or the packaged default), a path, or a CompiledPolicy."""
    if not isinstance(workload, WorkloadSpec):
        raise QuantizerConfigError(f"workload={workload!r} is invalid: allowed is a WorkloadSpec")
    if hardware is None:
        hardware = detect_hardware_info()
    elif not isinstance(hardware, HardwareInfo):
        raise QuantizerConfigError(f"hardware={hardware!r} is invalid: allowed is a HardwareInfo or None")
    compiled = resolve_policy(policy)
    decision = decide(compiled, facts_of(workload, hardware))
    return AutoConfigResult(decision.config, decision.reason, decision)
