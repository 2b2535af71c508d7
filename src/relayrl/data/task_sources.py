"""Built-in prompt sources named by a spec instead of a file: ``reasoning_gym:<task>`` and
``humaneval``, usable wherever a prompt file is (``data.train_path``, ``data.eval_path``,
``relayrl eval --data``).

Spec grammar: ``NAME[?key=value&key=value...]`` (``%XX`` escapes decoded; ``+`` is kept).
Values are read as ``true``/``false``, an integer, a float, a comma list (a tuple of strings,
e.g. ``operators=+,-``), else a string.

- ``reasoning_gym:<task>``: ``size`` (default 1000) problems of ``reasoning_gym.create_dataset(
  task, seed=seed, size=size, **rest)`` (``seed`` default 0; the other keys are the task's own
  config, e.g. ``max_terms=2``); score with ``reward.fn: reasoning_gym``
  (``relayrl.data.reasoning_gym_source``).
- ``humaneval``: the 164 HumanEval problems whose tests convert to the code harness's assert
  form (``relayrl.data.humaneval_source``); score with ``reward.fn: humaneval``.

Held out: with ``data.eval_path`` unset, ``data.eval_size`` seeded problems of the generated
set are held out and every training row with the same prompt text is dropped (the rule of any
prompt file, ``relayrl.data.prompts.hold_out.hold_out_rows``), so training never sees a
held-out problem, duplicates included.
"""

from __future__ import annotations

from urllib.parse import unquote

from relayrl.data.jsonl import DataError
from relayrl.data.records import PromptRecord

__all__ = ["is_task_source", "load_task_source", "parse_spec"]

Value = bool | int | float | str | tuple[str, ...]


def is_task_source(path: object) -> bool:
    """Whether ``path`` is a spec this module reads (not a file path)."""
    if not isinstance(path, str):
        return False
    name = path.split("?", 1)[0]
    return name.startswith("reasoning_gym:") or name == "humaneval"


def _value(text: str) -> Value:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if "," in text:
        return tuple(t for t in text.split(",") if t)
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Value]]:
    """``NAME?k=v&...`` -> (``NAME``, {k: value}) (module docstring); a key given twice or
    without ``=`` is a ``DataError``."""
    name, _, query = spec.partition("?")
    params: dict[str, Value] = {}
    for part in filter(None, query.split("&")):
        if "=" not in part:
            raise DataError(f"{spec}: {part!r} is not key=value")
        key, raw = (unquote(t) for t in part.split("=", 1))  # "+" stays "+" (an operator)
        if key in params:
            raise DataError(f"{spec}: {key!r} is given twice")
        params[key] = _value(raw)
    return name, params


def load_task_source(spec: str) -> list[PromptRecord]:
    """The prompt records of a spec (module docstring); a bad spec is a one-line
    ``DataError`` naming it."""
    name, params = parse_spec(spec)
    if name.startswith("reasoning_gym:"):
        from relayrl.data.reasoning_gym_source import reasoning_gym_records

        return reasoning_gym_records(name.removeprefix("reasoning_gym:"), params, spec)
    from relayrl.data.humaneval_source import humaneval_records

    if params:
        raise DataError(f"{spec}: humaneval takes no parameters, got {sorted(params)}")
    return humaneval_records()
