"""Trajectory export (``train.save_trajectories``): every trained trajectory of a step as JSONL.

``<run_dir>/trajectories.jsonl`` gets one line per trajectory the step trains (a multi-turn
episode split at a prefix break gives one line per segment; agent rollouts one per trajectory
of their session), appended step by step::

    {"step": 3, "index": 0, "group": 1, "score": 1.0, "prompt_ids": [...], "response_ids": [...],
     "loss_mask": [...], "behaviour_logprobs": [...], "versions": [...],
     "finish_reason": "eos", "error": null, "prompt": "...", "response": "...",
     "messages": [...], "stop_reason": "env_done", "turns": 2, "turn_rewards": [...],
     "outcome": 1.0, "tool_calls": 1, "tool_errors": 0, "prefix_breaks": 0, "segment_of": null}

``prompt`` / ``response`` are the decoded text (special tokens kept); ``messages`` the
episode's transcript (environment episodes) when there is one. :func:`read_trajectories`
reads the file back; ``relayrl report`` summarises it per step.

``step`` is the trainer's 0-based step: the row of the step logged as ``S`` in
``metrics.jsonl`` says ``S - 1``. A resume from the checkpoint of step S trains steps S+1..
again: before it appends, its claim of the run directory moves the rows with ``step >= S``
into ``trajectories.rewound-<S>.jsonl`` beside the file (``.<k>`` before ``.jsonl`` when that
name is taken; kept, never appended to), so the file holds each step's trajectories once, of
the training path the run follows (``relayrl.controller.run_dir``, streamed and durable:
``relayrl.durable.split_jsonl_log``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from relayrl.durable import read_jsonl_log
from relayrl.rollout.types import Sample

FILE = "trajectories.jsonl"
ENV_KEYS = (
    "stop_reason",
    "turns",
    "turn_rewards",
    "outcome",
    "tool_calls",
    "tool_errors",
    "prefix_breaks",
    "messages",
    "error",
    "turn_spans",
    "turn_step_rewards",
)


def _finite(x: Any) -> Any:
    return x if not isinstance(x, float) or math.isfinite(x) else None


def trajectory_record(
    step: int, index: int, sample: Sample, score: float, tokenizer: Any | None = None
) -> dict[str, Any]:
    """One trajectory's line (see module)."""
    n = len(sample.response_ids)
    env = dict(sample.metadata.get("env") or {})
    rec: dict[str, Any] = {
        "step": step,
        "index": index,
        "group": sample.group_id,
        "score": _finite(float(score)),
        "prompt_ids": list(sample.prompt_ids),
        "response_ids": list(sample.response_ids),
        "loss_mask": list(sample.loss_mask) if sample.loss_mask is not None else [1] * n,
        "behaviour_logprobs": [_finite(float(x)) for x in sample.behaviour_logprobs],
        "versions": list(sample.versions),
        "finish_reason": sample.finish_reason,
        "error": sample.error,
        "segment_of": env.get("segment_of"),
    }
    if tokenizer is not None:
        rec["prompt"] = tokenizer.decode(list(sample.prompt_ids), skip_special_tokens=False)
        rec["response"] = tokenizer.decode(list(sample.response_ids), skip_special_tokens=False)
    for k in ENV_KEYS:
        if k in env and k != "error":
            rec[k] = env[k]
    if env.get("error") and not rec["error"]:
        rec["error"] = env["error"]
    return rec


def save_trajectories(
    run_dir: str | Path,
    step: int,
    samples: Sequence[Sample],
    scores: Iterable[float],
    tokenizer: Any | None = None,
) -> int:
    """Append the step's trajectories to ``<run_dir>/trajectories.jsonl``; returns how many."""
    path = Path(run_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(trajectory_record(step, i, s, float(v), tokenizer), default=str)
        for i, (s, v) in enumerate(zip(samples, scores, strict=True))
    ]
    with path.open("a") as f:
        f.write("".join(x + "\n" for x in lines))
    return len(lines)


def read_trajectories(run_dir: str | Path) -> list[dict[str, Any]]:
    """The saved trajectories of a run (empty when it saved none). A torn last line (an append
    cut short by a kill or a power loss: no newline after it) is skipped with a warning naming
    the file and line; a bad line anywhere else is a ``ValueError`` naming them
    (``relayrl.durable.read_jsonl_log``). A resume cuts the torn line off before it appends."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    return [row for _, row in read_jsonl_log(path)]


def summarise(records: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per step: trajectories, mean score, model tokens, errors, prefix breaks."""
    out: dict[int, dict[str, float]] = {}
    for r in records:
        d = out.setdefault(
            int(r["step"]), {"trajectories": 0, "score_sum": 0.0, "model_tokens": 0, "errors": 0}
        )
        d["trajectories"] += 1
        d["score_sum"] += float(r.get("score") or 0.0)
        d["model_tokens"] += sum(r.get("loss_mask") or [])
        d["errors"] += r.get("error") is not None
    for d in out.values():
        d["score_mean"] = d.pop("score_sum") / max(d["trajectories"], 1)
    return out
