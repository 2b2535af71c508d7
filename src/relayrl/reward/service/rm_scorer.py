"""A trained reward model as a batched scorer, and mixing it with rule-based rewards.

The scorer interface (what ``RewardWorker`` and, later, the reward service call)::

    scorer.score_batch(prompts, completions, samples) -> list[float | dict[str, float]]

one forward pass per ``batch_size`` completions instead of one call per sample. A dict result
holds named components and a ``"score"`` key, like a reward function's dict return. Scorers
are also plain reward functions (``scorer(prompt, completion, sample)``), so anything that
only knows the per-sample interface still works.

Normalised score (default): r_norm = (r - mu) / sigma with mu, sigma the reward model's mean
and std over its own training completions (``relayrl_rm.json``), so a reward of +1 means one
standard deviation above the reference data, whatever scale the Bradley-Terry fit chose.
Mixed score: s = sum_k w_k * s_k over components k (rule-based functions and scorers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from relayrl.model.reward_model import RM_STATS_FILE, load_reward_model, score_texts
from relayrl.reward import get_reward_fn, score
from relayrl.reward.service.model_lanes import ModelScorer

__all__ = [
    "NO_RULE",
    "BatchScorer",
    "MixedReward",
    "RewardModelScorer",
    "build_reward_fn",
    "reward_model_scorers",
]

NO_RULE = "none"
"""``reward.fn: none`` with ``reward.model_path`` set: the reward model alone."""


BatchScorer = ModelScorer
"""Scores a batch of completions at once (model-based scorers): the reward service's
``ModelScorer`` protocol (``relayrl.reward.scorer``)."""


class RewardModelScorer:
    """Batched scoring with a reward model saved by ``relayrl rm`` (or any one-label
    ``AutoModelForSequenceClassification`` directory with its tokenizer).

    Args:
        path: the reward-model directory.
        batch_size: completions per forward pass.
        normalize: return (r - mu) / sigma with the statistics of ``relayrl_rm.json``
            (raw r when the file is missing).
        dtype: weights dtype; scores are returned in fp32.
        max_length: longest input kept (its last tokens); default the training setting.
    """

    def __init__(
        self,
        path: str | Path,
        batch_size: int = 64,
        normalize: bool = True,
        dtype: torch.dtype = torch.float32,
        max_length: int | None = None,
    ):
        from relayrl.model import load_tokenizer

        self.path = Path(path)
        self.tokenizer = load_tokenizer(self.path)
        self.model = load_reward_model(self.path, dtype, self.tokenizer.pad_token_id).eval()
        self.model.requires_grad_(False)
        self.batch_size = batch_size
        stats_file = self.path / RM_STATS_FILE
        self.stats: dict[str, Any] = (
            json.loads(stats_file.read_text()) if stats_file.is_file() else {}
        )
        self.max_length = max_length or int(self.stats.get("max_length", 512))
        self.mean, self.std = 0.0, 1.0
        if normalize and "reward_mean" in self.stats:
            self.mean = float(self.stats["reward_mean"])
            std = float(self.stats.get("reward_std", 1.0))
            self.std = std if math.isfinite(std) and std > 1e-6 else 1.0

    def raw_scores(self, prompts: Sequence[str], completions: Sequence[str]) -> torch.Tensor:
        """Unnormalised r(x, y) [N]."""
        return score_texts(
            self.model,
            self.tokenizer,
            list(prompts),
            list(completions),
            self.batch_size,
            self.max_length,
        )

    def score_batch(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        samples: Sequence[dict] | None = None,
    ) -> list[float]:
        """(r - mu) / sigma per completion (see the class docstring)."""
        r = self.raw_scores(prompts, completions)
        return ((r - self.mean) / self.std).tolist()

    def __call__(self, prompt: str, completion: str, sample: dict) -> float:
        return self.score_batch([prompt], [completion], [sample])[0]


class MixedReward:
    """Weighted sum of components: s = sum_k w_k s_k; each component is logged.

    A component is a batch scorer (``score_batch``) or a reward function
    ``fn(prompt, completion, sample) -> float | dict`` (its ``"score"`` is used).
    """

    def __init__(self, components: Sequence[tuple[str, Any, float]]):
        if not components:
            raise ValueError("MixedReward needs at least one component")
        names = [n for n, _, _ in components]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate reward component names: {names}")
        self.components = list(components)

    def score_batch(
        self, prompts: Sequence[str], completions: Sequence[str], samples: Sequence[dict]
    ) -> list[dict[str, float]]:
        n = len(prompts)
        out: list[dict[str, float]] = [{} for _ in range(n)]
        totals = [0.0] * n
        for name, comp, weight in self.components:
            if isinstance(comp, BatchScorer):
                values = [
                    _score_of(v, name) for v in comp.score_batch(prompts, completions, samples)
                ]
            else:
                values = [
                    score(comp, p, c, s)["score"]
                    for p, c, s in zip(prompts, completions, samples, strict=True)
                ]
            for i, v in enumerate(values):
                out[i][name] = v
                totals[i] += weight * v
        for i in range(n):
            out[i]["score"] = totals[i]
        return out

    def __call__(self, prompt: str, completion: str, sample: dict) -> dict[str, float]:
        return self.score_batch([prompt], [completion], [sample])[0]


def _no_reward(prompt: str, completion: str, sample: dict) -> float:
    raise ValueError(
        "reward.fn is 'none' but there is no reward.model_path nor reward.service.functions: "
        "nothing scores the samples"
    )


def _score_of(value: Any, name: str) -> float:
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"scorer {name!r} returned a dict without 'score'")
        return float(value["score"])
    return float(value)


def reward_model_scorers(reward_cfg: Any) -> list[tuple[str, RewardModelScorer, float]]:
    """``[("rm", scorer, model_weight)]`` when ``reward.model_path`` is set, else ``[]``:
    the ``(name, scorer, weight)`` triples the reward service's ``model_scorers`` take."""
    model_path = getattr(reward_cfg, "model_path", None)
    if model_path is None:
        return []
    scorer = RewardModelScorer(
        model_path,
        batch_size=getattr(reward_cfg, "model_batch_size", 64),
        normalize=getattr(reward_cfg, "model_normalize", True),
    )
    return [("rm", scorer, float(getattr(reward_cfg, "model_weight", 1.0)))]


def build_reward_fn(
    reward_cfg: Any, scorers: list[tuple[str, Any, float]] | None = None
) -> Callable[..., Any]:
    """The reward of a run config's ``reward`` section.

    - no ``model_path``: the rule-based function ``fn`` (as before);
    - ``model_path`` and ``fn: none``: the reward model alone, weighted by ``model_weight``;
    - ``model_path`` and a rule ``fn``: s = s_fn + model_weight * s_rm (components ``fn``
      name and ``rm`` logged separately).

    ``scorers`` reuses already loaded ``reward_model_scorers(reward_cfg)`` (one copy of the
    reward model shared with the reward service).
    """
    fn_spec = reward_cfg.fn
    if scorers is None:
        scorers = reward_model_scorers(reward_cfg)
    if not scorers:
        if fn_spec is None or str(fn_spec).strip().lower() == NO_RULE:
            return _no_reward  # the reward service's functions score instead (or nothing does)
        return get_reward_fn(fn_spec)
    _, scorer, weight = scorers[0]
    if fn_spec is None or str(fn_spec).strip().lower() == NO_RULE:
        if weight == 1.0:
            return scorer
        return MixedReward([("rm", scorer, weight)])
    name = str(fn_spec).rsplit(":", 1)[-1]
    return MixedReward([(name, get_reward_fn(fn_spec), 1.0), ("rm", scorer, weight)])
