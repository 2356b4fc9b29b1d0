"""Flags and helpers shared by subcommands."""

from __future__ import annotations

import argparse
import json

from veloxquant_mlx.config.hardware import HardwareInfo, detect_hardware_info
from veloxquant_mlx.config.workload import WorkloadSpec
from veloxquant_mlx.errors import QuantizerConfigError


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is invalid: allowed is an integer >= 0")
    return value


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    w = WorkloadSpec()
    parser.add_argument("--head-dim", type=int, default=w.head_dim, help=f"(default {w.head_dim})")
    parser.add_argument("--seq-len", type=int, default=w.seq_len, help=f"(default {w.seq_len})")
    parser.add_argument("--n-layers", type=int, default=w.n_layers, help=f"(default {w.n_layers})")
    parser.add_argument("--batch-size", type=int, default=w.batch_size, help=f"(default {w.batch_size})")
    memory = parser.add_argument_group("memory (without these flags: detected from MLX)")
    memory.add_argument("--total-memory-bytes", type=_non_negative, default=None)
    memory.add_argument("--active-memory-bytes", type=_non_negative, default=None)
    memory.add_argument("--unknown-memory", action="store_true",
                        help="treat the memory total as unknown instead of detecting it")


def workload_from(args) -> tuple[WorkloadSpec, HardwareInfo]:
    workload = WorkloadSpec(head_dim=args.head_dim, seq_len=args.seq_len, n_layers=args.n_layers,
                            batch_size=args.batch_size)
    if args.unknown_memory and args.total_memory_bytes is not None:
        raise QuantizerConfigError("--unknown-memory and --total-memory-bytes contradict: give one")
    if args.unknown_memory:
        return workload, HardwareInfo(None, args.active_memory_bytes or 0)
    if args.total_memory_bytes is None:
        if args.active_memory_bytes is not None:
            raise QuantizerConfigError("--active-memory-bytes needs --total-memory-bytes (or "
                                       "--unknown-memory)")
        return workload, detect_hardware_info()
    return workload, HardwareInfo(args.total_memory_bytes, args.active_memory_bytes or 0)


def print_json(data) -> None:
    print(json.dumps(data, indent=2, sort_keys=False))
