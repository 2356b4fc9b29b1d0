"""`veloxquant policy validate | lint | explain | simulate | diff`: work on policy files."""

from __future__ import annotations

from veloxquant_mlx.cli.common import add_json_flag, add_workload_flags, print_json, workload_from
from veloxquant_mlx.policy.diff import diff_policies, format_diff
from veloxquant_mlx.policy.evaluator import decide
from veloxquant_mlx.policy.facts import facts_of
from veloxquant_mlx.policy.lint import format_report, lint_policy
from veloxquant_mlx.policy.simulate import format_table, simulate_policy
from veloxquant_mlx.policy.sources import load_policy

HELP = "validate, lint, explain, simulate or diff policy files"


def _validate(args) -> int:
    policy = load_policy(args.file)
    summary = {"valid": True, "name": policy.name, "version": policy.version, "sha256": policy.sha256,
               "rules": [r.id for r in policy.rules], "adjustments": [a.id for a in policy.adjustments]}
    if args.json:
        print_json(summary)
    else:
        print(f"valid: policy {policy.name} v{policy.version}, {len(policy.rules)} rules, "
              f"{len(policy.adjustments)} adjustments, sha256 {policy.sha256}")
    return 0


def _lint(args) -> int:
    report = lint_policy(load_policy(args.file))
    print_json(report.to_dict()) if args.json else print(format_report(report))
    return 1 if report.findings else 0


def _explain(args) -> int:
    policy = load_policy(args.file)
    workload, hardware = workload_from(args)
    decision = decide(policy, facts_of(workload, hardware))
    print_json(decision.to_dict()) if args.json else print(decision.explain())
    return 0


def _simulate(args) -> int:
    result = simulate_policy(load_policy(args.file))
    print_json(result) if args.json else print(format_table(result))
    return 1 if any(row["decision"] == "GAP" for row in result["rows"]) else 0


def _diff(args) -> int:
    result = diff_policies(load_policy(args.old), load_policy(args.new))
    print_json(result) if args.json else print(format_diff(result))
    return 1 if result["changes"] else 0


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="policy_command", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("validate", help="parse, check against the schema and compile (exit 2 if invalid)")
    p.add_argument("file")
    p.set_defaults(_run=_validate)
    p = sub.add_parser("lint", help="coverage of the fact space, unreachable rules, inert adjustments "
                                    "(exit 1 on findings)")
    p.add_argument("file")
    p.set_defaults(_run=_lint)
    p = sub.add_parser("explain", help="the decision and its trail for one workload")
    p.add_argument("file")
    add_workload_flags(p)
    p.set_defaults(_run=_explain)
    p = sub.add_parser("simulate", help="decisions over seq_len x head_dim x pressure bands "
                                        "(exit 1 if a band has no decision)")
    p.add_argument("file")
    p.set_defaults(_run=_simulate)
    p = sub.add_parser("diff", help="regions of the fact space whose decision changes (exit 1 if any)")
    p.add_argument("old")
    p.add_argument("new")
    p.set_defaults(_run=_diff)
    for child in sub.choices.values():
        add_json_flag(child)


def run(args) -> int:
    return args._run(args)
