"""How a finished episode is scored and trained, given the run's reward function.

- ``scoring_view(sample)``: what the reward function sees of an episode: the final assistant
  turn's tokens as the completion (not the observations and tool calls before it); the
  row's fields stay in ``metadata``. A single-turn sample is its own view.
- ``episode_scores(samples, scores, outcome, turn_reward_coef)``: the episode's score:
  the reward function's score of the view (``outcome: reward_fn``) or the environment's final
  reward (``outcome: env``; 0 when it gave none), plus ``turn_reward_coef`` x the sum of the
  per-turn rewards; 0 for an episode that failed (``env_error`` / ``timeout`` / ``abort``).
- ``EpisodeScorer(reward)``: the run's reward role with both applied (``score``,
  ``outcomes``; everything else delegated), so every caller that scores samples -- the sync
  step, dynamic sampling, the async controller's inline scoring, the held-out evaluation --
  scores episodes the same way without knowing about them.
- ``expand_segments(samples, scores)``: an episode split at a prefix break trains each
  segment as a sample of its own, with the episode's score and group; ``expand_episodes``
  also says which episode each row came from, so that GRPO's group statistics count such an
  episode once, not once per segment (``env/prefix_breaks`` says how often it happens).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from relayrl.reward.scorer import Scorer
from relayrl.reward.service.server import RewardService
from relayrl.rollout.types import Sample

NOT_SCORED = ("env_error", "timeout", "abort")


def env_info(sample: Sample) -> dict[str, Any] | None:
    """The episode record of a multi-turn sample (``metadata["env"]``), None for single-turn."""
    info = sample.metadata.get("env")
    return info if isinstance(info, dict) and "stop_reason" in info else None


def scoring_view(sample: Sample) -> Sample:
    """The sample the reward function scores (see module); shares ``metadata``."""
    info = env_info(sample)
    if info is None or info.get("final_turn") is None:
        return sample
    a, b = info["final_turn"]
    return dataclasses.replace(
        sample,
        response_ids=sample.response_ids[a:b],
        behaviour_logprobs=sample.behaviour_logprobs[a:b],
        versions=sample.versions[a:b],
        loss_mask=None,
    )


def episode_scores(
    samples: Sequence[Sample],
    scores: Tensor,
    outcome: str = "reward_fn",
    turn_reward_coef: float = 0.0,
) -> Tensor:
    """Scores [B] of ``samples`` from the reward function's ``scores`` of their views."""
    out = scores.clone().to(torch.float32)
    for i, s in enumerate(samples):
        info = env_info(s)
        if info is None:
            continue
        if info["stop_reason"] in NOT_SCORED:
            out[i] = 0.0
            continue
        if outcome == "env":
            out[i] = float(info.get("outcome") or 0.0)
        out[i] += turn_reward_coef * float(sum(info.get("turn_rewards") or []))
    return out


def expand_segments(samples: Sequence[Sample], scores: Tensor) -> tuple[list[Sample], Tensor]:
    """Every episode's earlier segments before it, with its score (see module)."""
    out, values, _ = expand_episodes(samples, scores)
    return out, values


def expand_episodes(
    samples: Sequence[Sample], scores: Tensor
) -> tuple[list[Sample], Tensor, list[int]]:
    """:func:`expand_segments` plus each row's episode: the index in ``samples`` of the episode
    it came from (its segments share it), so that group statistics can count an episode once."""
    if not any((env_info(s) or {}).get("segments") for s in samples):
        return list(samples), scores, list(range(len(samples)))
    out, values, episodes = [], [], []
    for i, (s, v) in enumerate(zip(samples, scores.tolist(), strict=True)):
        for seg in (env_info(s) or {}).get("segments") or []:
            seg.group_id = s.group_id
            out.append(seg)
            values.append(v)
            episodes.append(i)
        out.append(s)
        values.append(v)
        episodes.append(i)
    return out, torch.tensor(values, dtype=torch.float32), episodes


class EpisodeScorer:
    """The reward role for episodes (see module); single-turn samples pass through as they are.
    A :class:`~relayrl.reward.Scorer` over the run's (``inner``)."""

    def __init__(
        self, inner: Scorer, outcome: str = "reward_fn", turn_reward_coef: float = 0.0
    ) -> None:
        self.inner = inner
        self.outcome = outcome
        self.turn_reward_coef = turn_reward_coef

    def score(self, samples: Sequence[Sample]) -> tuple[Tensor, dict[str, float]]:
        """Scores [B] of the episodes and the reward function's component means."""
        scores, stats = self.inner.score([scoring_view(s) for s in samples])
        return self.finish(samples, scores), stats

    def finish(self, samples: Sequence[Sample], scores: Tensor) -> Tensor:
        """The episodes' scores from the reward function's scores of their views."""
        return episode_scores(samples, scores, self.outcome, self.turn_reward_coef)

    def renormalize(self, samples: Sequence[Sample], left_out: Sequence[bool]) -> Tensor | None:
        """The episodes' scores from the inner role's scores normalised again over
        ``samples`` as one batch (``RewardWorker.renormalize``); None when nothing to redo."""
        redo = getattr(self.inner, "renormalize", None)
        scores = redo(samples, left_out) if redo is not None else None
        return None if scores is None else self.finish(samples, scores)

    def outcomes(self, samples: Sequence[Sample], scores: Tensor) -> Tensor:
        """Raw verifiable outcomes: the reward function's (the service's recorded outcome of
        the final turn), the environment's with ``outcome: env``, 0 for a failed episode."""
        out = self.inner.outcomes(samples, scores).clone()
        for i, s in enumerate(samples):
            info = env_info(s)
            if info is None:
                continue
            if info["stop_reason"] in NOT_SCORED:
                out[i] = 0.0
            elif self.outcome == "env":
                out[i] = float(info.get("outcome") or 0.0)
        return out

    @property
    def service(self) -> RewardService | None:
        return self.inner.service

    @property
    def fn(self) -> Callable[..., Any]:
        return self.inner.fn

    def decode(self, sample: Sample) -> str:
        return self.inner.decode(sample)

    def progress(self) -> int:
        return self.inner.progress()

    def close(self) -> None:
        self.inner.close()
