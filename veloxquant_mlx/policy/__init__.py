"""The policy engine: parse (loader) -> pick the version's schema (versions) -> compile
(compiler) -> evaluate (evaluator) -> decision with its trail (decision). sources resolves
where a policy comes from; lint, simulate and diff analyse a policy over the fact space
(bands); perf is the committed benchmark."""

from veloxquant_mlx.policy.compiler import CompiledPolicy, compile_policy_text
from veloxquant_mlx.policy.decision import Decision
from veloxquant_mlx.policy.evaluator import decide
from veloxquant_mlx.policy.facts import FACTS, facts_of
from veloxquant_mlx.policy.sources import default_policy_path, load_policy, resolve_policy

__all__ = [
    "CompiledPolicy", "Decision", "FACTS", "compile_policy_text", "decide", "default_policy_path",
    "facts_of", "load_policy", "resolve_policy",
]
