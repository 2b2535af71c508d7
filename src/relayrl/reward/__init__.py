"""Rewards (DESIGN.md layer 4; must not import ``data`` or anything above ``reward``).

- reward functions ``fn(prompt, completion, sample) -> float | dict``, a name registry and
  import paths (``functions``), built-ins (``arithmetic``, ``exact_match``, ``math``,
  ``regex``, ``format``, ``overlong``, ``code``: ``builtin``), the math answer verifier
  (``math``); the built-in task sources' ``reasoning_gym`` and ``humaneval``
  (``task_rewards``);
- the code sandbox (``sandbox``; bubblewrap where installed) and the harness whose verdict
  the program under test cannot reach (``sandbox.code_harness``);
- weighted mixing, per-domain z-scores and batch logging (``mixing``);
- the asynchronous reward service with a process pool and batched model scorers
  (``service``);
- the reward role's protocol and the batched scorer's (``scorer``).
"""

from relayrl.reward import builtin as _builtin  # noqa: F401  (registers the built-ins)
from relayrl.reward import task_rewards as _task_rewards  # noqa: F401  (reasoning_gym, humaneval)
from relayrl.reward.builtin import (
    code_tests,
    extract_code,
    format_tags,
    math_answer,
    overlong_penalty,
    regex_match,
)
from relayrl.reward.functions import (
    REWARD_FUNCTIONS,
    RewardFn,
    RewardFunctionError,
    RewardSpecError,
    arithmetic,
    evaluate,
    exact_match,
    get_reward_fn,
    register_reward_fn,
    score,
)
from relayrl.reward.math.answer import (
    answers_equal,
    extract_final_answer,
    parse_answer,
    verify_math,
)
from relayrl.reward.mixing import (
    RewardMix,
    RewardSpec,
    ScoreResult,
    batch_reward_stats,
    zscore_by_domain,
)
from relayrl.reward.sandbox import (
    Sandbox,
    SandboxLimits,
    SandboxResult,
    detect_isolation,
    run_python,
)
from relayrl.reward.scorer import BatchScorer, Scorer
from relayrl.reward.service import (
    ModelScorer,
    RewardService,
    ServiceClosed,
    build_reward_service,
    service_enabled,
)
from relayrl.reward.verifiers import (
    END_MARKERS,
    extract_integer_answer,
    parse_int_answer,
    strip_special_tokens,
)

__all__ = [
    "END_MARKERS",
    "REWARD_FUNCTIONS",
    "BatchScorer",
    "ModelScorer",
    "RewardFn",
    "RewardFunctionError",
    "RewardMix",
    "RewardService",
    "RewardSpec",
    "RewardSpecError",
    "Scorer",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "ScoreResult",
    "ServiceClosed",
    "answers_equal",
    "build_reward_service",
    "arithmetic",
    "batch_reward_stats",
    "code_tests",
    "detect_isolation",
    "evaluate",
    "exact_match",
    "extract_code",
    "extract_final_answer",
    "extract_integer_answer",
    "format_tags",
    "get_reward_fn",
    "math_answer",
    "overlong_penalty",
    "parse_answer",
    "parse_int_answer",
    "regex_match",
    "register_reward_fn",
    "run_python",
    "score",
    "service_enabled",
    "strip_special_tokens",
    "verify_math",
    "zscore_by_domain",
]
