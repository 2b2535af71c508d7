"""Rewards of the built-in task sources: ``reasoning_gym`` (the task's own scorer on the answer
parsed from free text) and ``humaneval`` (the sandboxed code reward with the problem's imports).

``reasoning_gym(prompt, completion, sample)``: the answer is, in this order, the last
``<answer>...</answer>`` span (the tag reasoning-gym's own prompts ask for); else, when the
reference answer is a number, the last number in the text (``-?\\d[\\d,]*(\\.\\d+)?``, commas
removed, a trailing ``.0`` dropped when the reference is an integer); else the last non-empty
line. It is scored by ``reasoning_gym.get_score_answer_fn(sample["rg_task"])(answer, entry)``
with ``entry = {question, answer, metadata}`` rebuilt from the sample. Returns ``{"score": s,
"answered": 1 if an answer was found}``; ``s`` is in [0, 1] and 1 only for a correct answer
(partial credit below: the base scorer gives ``len(ref) / len(answer)`` when the reference is
a substring of the answer), so ``pass_rate`` (score >= 1) is the accuracy.

``humaneval(prompt, completion, sample)``: ``code_tests`` on the completion's code, preceded by
the problem's import lines (``sample["code_header"]``) so a solution that uses ``List`` as the
prompt's signature does still runs; a completion that does not define
``sample["entry_point"]`` is taken as the function's body and appended to the prompt's code
(``sample["code_prompt"]``).
"""

from __future__ import annotations

import functools
import re
from typing import Any

from relayrl.reward.builtin import code_tests, extract_code
from relayrl.reward.functions import register_reward_fn
from relayrl.reward.verifiers import strip_special_tokens

__all__ = ["extract_task_answer", "humaneval_tests", "reasoning_gym_score"]

_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.S)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_NUMERIC_REF = re.compile(r"-?\d+(?:\.\d+)?")


def extract_task_answer(completion: str, reference: str | None) -> str | None:
    """The answer in a free-text completion (module docstring), or None when there is none."""
    text = strip_special_tokens(completion) if isinstance(completion, str) else ""
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1].strip()
    if reference is not None and _NUMERIC_REF.fullmatch(reference.strip()):
        numbers = _NUMBER.findall(text)
        if not numbers:
            return None
        found = numbers[-1].replace(",", "")
        if "." not in reference and re.fullmatch(r"-?\d+\.0+", found):
            found = found.split(".")[0]
        return found
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


@functools.lru_cache(maxsize=64)
def _scorer(task: str) -> Any:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


@register_reward_fn("reasoning_gym")
def reasoning_gym_score(prompt: str, completion: str, sample: dict) -> dict[str, Any]:
    """The reasoning-gym task's own score of the parsed answer (module docstring)."""
    task = sample.get("rg_task") if isinstance(sample, dict) else None
    if not isinstance(task, str):
        raise ValueError(
            "reward.fn reasoning_gym needs samples from data.train_path: reasoning_gym:<task> "
            "(no 'rg_task' field)"
        )
    reference = sample.get("answer")
    answer = extract_task_answer(completion, reference)
    entry = {"question": prompt, "answer": reference, "metadata": sample.get("rg_metadata") or {}}
    score = float(_scorer(task)(answer, entry)) if answer is not None else 0.0
    return {"score": min(1.0, max(0.0, score)), "answered": float(answer is not None)}


@register_reward_fn("humaneval")
def humaneval_tests(prompt: str, completion: str, sample: dict, **kwargs: Any) -> dict[str, Any]:
    """``code_tests`` on the completion's function with the problem's imports (module
    docstring); ``kwargs`` go to ``code_tests`` (limits, ``partial_credit``)."""
    code = extract_code(completion)
    entry = str(sample.get("entry_point") or "")
    if entry and not re.search(rf"\bdef\s+{re.escape(entry)}\s*\(", code):
        code = str(sample.get("code_prompt") or "") + code  # a body: complete the prompt's def
    program = str(sample.get("code_header") or "") + "\n" + code
    out = code_tests(prompt, f"```python\n{program}\n```", sample, **kwargs)
    assert isinstance(out, dict)  # code_tests returns its dict form
    return out
