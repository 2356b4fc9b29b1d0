"""`veloxquant auto-config`: the KV-cache config the policy chooses for a workload."""

from __future__ import annotations

from veloxquant_mlx.cli.common import add_json_flag, add_workload_flags, print_json, workload_from
from veloxquant_mlx.config.auto_config import select_kv_cache_config

HELP = "choose a KV-cache config for a workload through the policy"


def add_arguments(parser) -> None:
    add_workload_flags(parser)
    parser.add_argument("--policy", metavar="FILE", default=None,
                        help="policy file (default: $VELOXQUANT_POLICY, else the packaged policy)")
    parser.add_argument("--explain", action="store_true",
                        help="show the trail: every rule tried, the facts it saw, the adjustments")
    add_json_flag(parser)


def run(args) -> int:
    workload, hardware = workload_from(args)
    result = select_kv_cache_config(workload, hardware, policy=args.policy)
    if args.json:
        out = {"config": result.config.to_dict(), "reason": result.reason}
        if args.explain:
            out["decision"] = result.decision.to_dict()
        print_json(out)
    elif args.explain:
        print(result.decision.explain())
    else:
        print("config: " + ", ".join(f"{k}={v}" for k, v in result.config.to_dict().items()))
        print(f"reason: {result.reason}")
    return 0
