"""The ``eval`` section: how held-out evaluation samples (``relayrl eval`` and the evals inside
training, ``relayrl.controller.evaluate``).

The default (``n: 1``, greedy) is the greedy pass rate relayrl has always reported. With
``n`` > 1 each prompt gets ``n`` sampled answers, and pass@k (the unbiased estimator of Chen
et al. 2021) and maj@k (majority vote over the extracted answers) are reported for each
``k`` in ``k``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from relayrl.config.base import KeyProblem, Seed, _Strict

PositiveInt = Annotated[int, Field(ge=1)]


class EvalConfig(_Strict):
    n: int = Field(1, ge=1)
    """Samples per prompt."""
    k: list[PositiveInt] | None = None
    """The k of pass@k and maj@k (each in 1..n; null: 1 and n)."""
    greedy: bool | None = None
    """Argmax decoding; null: greedy when ``n`` is 1, sampling otherwise."""
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    """Answer length limit in tokens (null: ``rollout.max_tokens``)."""
    answer: Literal["auto", "integer", "math", "text"] = "auto"
    """How maj@k reads an answer: ``integer`` (the last integer, as the arithmetic reward
    does), ``math`` (the final / boxed answer, normalised), ``text`` (the stripped completion);
    ``auto``: ``integer`` for ``reward.fn: arithmetic``, ``math`` for ``math``, else ``text``."""
    seed: Seed | None = None
    """Sampling seed of the eval requests (prompt i, sample j gets ``seed + i * n + j``);
    null: the engine's own stream."""
    background: bool = True
    """``async`` / ``overlap`` without environments: the evaluations every
    ``train.eval_every`` steps run beside training instead of stalling it
    (``relayrl.controller.background_eval``); false: the trainer waits for them."""
    replica: Literal["shared", "separate"] = "shared"
    """Where a background evaluation generates. ``shared``: on the rollout engine, in its
    evaluation lane beside training's requests (a weight update may re-prefill it under newer
    weights: ``eval/version_min`` / ``eval/version_max``). ``separate`` (``cluster: local``):
    on an engine of its own in the trainer's process, loaded with the actor's weights when the
    evaluation starts, so every token is of that version (``eval/at_step``) and training's
    engine gets none of its requests (``relayrl.controller.eval_replica``)."""

    @model_validator(mode="after")
    def _checks(self) -> EvalConfig:
        if self.greedy and self.n > 1:
            raise KeyProblem(
                "greedy",
                True,
                f"greedy decoding gives {self.n} identical answers per prompt: use n: 1, or "
                "greedy: false to sample",
                related=("n",),
            )
        for k in self.k or []:
            if not 1 <= k <= self.n:
                raise KeyProblem("k", self.k, f"k={k} is outside 1..n (n={self.n})", related=("n",))
        return self

    @property
    def is_greedy(self) -> bool:
        return self.n == 1 if self.greedy is None else self.greedy

    @property
    def ks(self) -> list[int]:
        """The k values reported, ascending, without repeats."""
        return sorted(set(self.k or [1, self.n]))
