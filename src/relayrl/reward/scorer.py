"""The reward seam: what the reward role (``Roles.reward``) and a batched scorer implement.

- :class:`Scorer`: the reward role the controller calls (``workers.reward.RewardWorker``, and
  ``env.scoring.EpisodeScorer`` over it for episodes): ``score`` a batch of finished samples,
  ``finish`` the scores the reward service returned for their views, raw ``outcomes``, the
  ``service`` (or None: scored inline), ``progress`` for the stall watchdog, ``close``.
- :class:`BatchScorer`: a model-based scorer (a reward model, a judge, a mixture of them) with
  one ``score_batch(prompts, completions, samples)`` call per batch; checked with
  ``isinstance`` where a reward function is taken (``RewardWorker``, ``RewardService``). A
  plain reward function is ``fn(prompt, completion, sample) -> float | dict``
  (``relayrl.reward.functions``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from relayrl.reward.service.model_lanes import ModelScorer as BatchScorer
from relayrl.reward.service.server import RewardService
from relayrl.rollout.types import Sample

__all__ = ["BatchScorer", "Scorer"]


@runtime_checkable
class Scorer(Protocol):
    """The reward role. Scores are per sample, float32 ``[B]``: the raw verifiable outcome of
    the reward function (or the service's weighted mixture); shaping and KL penalties are the
    algorithm's. A sample whose scoring failed scores 0 and carries the error in
    ``metadata["reward"]["error"]`` (the controller leaves it out of training)."""

    @property
    def service(self) -> RewardService | None:
        """The asynchronous reward service, or None (scored inline by ``fn``)."""
        ...

    @property
    def fn(self) -> Callable[..., Any]:
        """The inline reward function (named in failure messages)."""
        ...

    def score(self, samples: Sequence[Sample]) -> tuple[Tensor, dict[str, float]]:
        """Scores ``[B]`` and the batch means of every named component (``reward/*``)."""
        ...

    def finish(self, samples: Sequence[Sample], scores: Tensor) -> Tensor:
        """The scores of ``samples`` from the scores the service gave their scoring views
        (the identity for single-turn samples; an episode's failures and turn rewards)."""
        ...

    def outcomes(self, samples: Sequence[Sample], scores: Tensor) -> Tensor:
        """The raw verifiable outcome per sample (pass rates, filters)."""
        ...

    def decode(self, sample: Sample) -> str:
        """The completion text of ``sample``."""
        ...

    def progress(self) -> int:
        """Samples scored so far (only grows; read from another thread)."""
        ...

    def close(self) -> None:
        """Stop the service, if any."""
        ...
