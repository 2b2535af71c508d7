"""Reward functions: plain functions, a name registry, and score normalisation.

A reward function is ``fn(prompt: str, completion: str, sample: dict) -> float | dict``.
``sample`` is the dataset row (``answer`` plus any extra fields; the reward service adds
``response_length`` in tokens and ``finish_reason``). The return contract: a number (the
score), or a dict with a ``"score"`` (the number trained on) and optional named components
(e.g. ``{"score": 1.1, "correct": 1.0, "format": 0.1}``, logged as metrics, never summed)
and one string under ``"reason"`` (why it scored so, e.g. a sandbox timeout), recorded.
Anything else (a dict without ``"score"``, a string, None) is a ``TypeError`` naming the
function and the value. ``score`` turns either form into a flat ``dict[str, float]``;
``evaluate`` also returns the reason. Functions are module-level so that a process pool can
pickle them.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from relayrl.reward.verifiers import extract_integer_answer, parse_int_answer

__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardFunctionError",
    "RewardSpecError",
    "arithmetic",
    "evaluate",
    "exact_match",
    "get_reward_fn",
    "register_reward_fn",
    "score",
]

RewardFn = Callable[[str, str, dict], float | dict[str, float]]

REWARD_FUNCTIONS: dict[str, RewardFn] = {}
_Fn = TypeVar("_Fn", bound=Callable[..., Any])
MOVED_MODULES = {"relayrl.rlhf.city_lang": "relayrl.data.city_lang"}
"""Modules of reward functions that moved: a spec naming the old module (the configs of runs
made before the move, e.g. ``monitor.gold_fn`` of a lab run) resolves to the new one."""


class RewardSpecError(ValueError):
    """A reward function spec names nothing usable."""


class RewardFunctionError(RuntimeError):
    """A reward function scored inline raised, or broke its return contract (one line naming
    the function); the trainer checkpoints the last completed step and ends the run."""


def fn_name(fn: Any) -> str:
    """``module:qualname`` of a reward function (a partial's function), for messages."""
    inner = getattr(fn, "func", fn)
    qual = getattr(inner, "__qualname__", None) or repr(inner)
    module = getattr(inner, "__module__", None)
    return f"{module}:{qual}" if module and module != "builtins" else qual


def register_reward_fn(name: str) -> Callable[[_Fn], _Fn]:
    """Decorator: register ``fn`` under ``name`` so configs can say ``reward: name``. ``fn``
    keeps its own signature: keyword arguments past ``(prompt, completion, sample)`` come
    from the reward spec (``kwargs``), and a dict result may hold a ``"reason"`` string."""

    def deco(fn: _Fn) -> _Fn:
        if name in REWARD_FUNCTIONS and REWARD_FUNCTIONS[name] is not fn:
            raise ValueError(f"reward function {name!r} is already registered")
        REWARD_FUNCTIONS[name] = fn
        return fn

    return deco


def _answer(sample: Any) -> Any:
    return sample.get("answer") if isinstance(sample, Mapping) else None


@register_reward_fn("arithmetic")
def arithmetic(prompt: str, completion: str, sample: dict) -> float:
    """1.0 if the completion's integer answer equals ``int(sample['answer'])``, else 0.0.

    The answer is read by ``extract_integer_answer``. A missing or non-integer ``answer``
    field gives 0.0; never raises.
    """
    target = parse_int_answer(_answer(sample))
    if target is None:
        return 0.0
    predicted = extract_integer_answer(completion)
    return 1.0 if predicted is not None and predicted == target else 0.0


@register_reward_fn("exact_match")
def exact_match(prompt: str, completion: str, sample: dict) -> float:
    """1.0 if ``completion.strip() == str(sample['answer']).strip()``, else 0.0.

    A missing (or null) answer gives 0.0; never raises.
    """
    target = _answer(sample)
    if target is None or not isinstance(completion, str):
        return 0.0
    try:
        return 1.0 if completion.strip() == str(target).strip() else 0.0
    except Exception:  # a broken __str__ on a custom answer object
        return 0.0


def get_reward_fn(spec: str) -> RewardFn:
    """Resolve a registered name (``"arithmetic"``) or an import path (``"pkg.mod:fn"``).

    The module is searched on ``sys.path`` and then in the current directory (appended to
    ``sys.path`` when missing, as under the ``relayrl`` console script: ``my_rewards:score``
    finds ``./my_rewards.py``; spawned reward workers inherit the path). Raises
    ``RewardSpecError`` naming the spec when it cannot be resolved.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise RewardSpecError(f"reward function spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" not in spec:
        known = ", ".join(sorted(REWARD_FUNCTIONS))
        raise RewardSpecError(
            f"unknown reward function {spec!r}: not a registered name ({known}) "
            "nor an import path 'module:function'"
        )
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RewardSpecError(f"reward function {spec!r}: expected 'module:function'")
    module_name = MOVED_MODULES.get(module_name, module_name)  # configs of older runs
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name + ".").startswith(e.name + "."):
            raise RewardSpecError(  # the module exists; something it imports does not
                f"reward function {spec!r}: cannot import module {module_name!r}: {e}"
            ) from e
        raise RewardSpecError(
            f"reward function {spec!r}: cannot import module {module_name!r}: no module "
            f"{e.name!r} on sys.path nor in the current directory ({cwd})"
        ) from e
    except Exception as e:
        raise RewardSpecError(
            f"reward function {spec!r}: cannot import module {module_name!r}: {e}"
        ) from e
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise RewardSpecError(
                f"reward function {spec!r}: module {module_name!r} has no attribute {attr!r}"
            ) from e
    if not callable(obj):
        raise RewardSpecError(f"reward function {spec!r}: {attr!r} is not callable")
    return obj


def _as_float(value: Any, what: str) -> float:
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {_shown(value)}")
    try:
        if hasattr(value, "item"):  # numpy / torch scalars
            value = value.item()
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be a number, got {type(value).__name__} {_shown(value)}"
        ) from e


def _shown(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_FN_COMPONENTS = 66  # 64 components, "score" and "reason"


def evaluate(
    fn: RewardFn, prompt: str, completion: str, sample: dict
) -> tuple[dict[str, float], str | None]:
    """Call ``fn``; return its components as ``dict[str, float]`` (with ``"score"``) and the
    reason it gave (a ``"reason"`` string in a dict result), or None.

    A number ``x`` becomes ``{"score": x}``. A dict keeps its components (as floats) and
    must hold ``"score"`` (components are not summed into one: which of them is the reward is
    the function's to say). Any other return type, a dict without ``"score"``, a non-string
    key, or a non-numeric component raises ``TypeError`` naming the function and the value;
    a NaN score, a non-finite component or more than ``MAX_FN_COMPONENTS`` entries raise
    ``ValueError``. Exceptions raised by ``fn`` propagate.
    """
    name = fn_name(fn)
    result = fn(prompt, completion, sample)
    reason: str | None = None
    if isinstance(result, Mapping):
        if len(result) > MAX_FN_COMPONENTS:
            raise ValueError(
                f"reward function {name}: {len(result)} components, at most "
                f"{MAX_FN_COMPONENTS} allowed"
            )
        out: dict[str, float] = {}
        for key, value in result.items():
            if not isinstance(key, str):
                raise TypeError(f"reward function {name}: component key {key!r} is not a str")
            if key == "reason":
                if value is not None:
                    reason = str(value)
                continue
            out[key] = _as_float(value, f"reward function {name}: component {key!r}")
        if "score" not in out:
            raise TypeError(
                f"reward function {name} returned {_shown(result)}: a dict needs a 'score' "
                "(the reward; other keys are logged components, never summed)"
            )
    else:
        out = {"score": _as_float(result, f"reward function {name}: return value")}
    if math.isnan(out["score"]):
        raise ValueError(f"reward function {name}: score is NaN")
    for key, value in out.items():
        if not math.isfinite(value):
            raise ValueError(f"reward function {name}: component {key!r} is {value!r}")
    return out, reason


def score(fn: RewardFn, prompt: str, completion: str, sample: dict) -> dict[str, float]:
    """Call ``fn`` and return its result as ``dict[str, float]`` with a ``"score"`` key.

    See ``evaluate`` (this drops the reason). Exceptions raised by ``fn`` propagate.
    """
    return evaluate(fn, prompt, completion, sample)[0]
