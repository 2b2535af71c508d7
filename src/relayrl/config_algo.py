"""Algorithm sub-sections of the run config (``algo.rollout_correction``).

A leaf like ``relayrl.config`` (it imports nothing from relayrl; ``config`` imports it), kept
apart so the main config module stays small. Cross-field checks of these sections live in
``AlgoConfig._cross_checks``, which names the key in its error.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EmptyRows = Literal["count", "skip"]
"""``algo.seq_mean_empty_rows``: whether the ``seq-mean-*`` denominators count the rows of a step
that have no response token (``count``, relayrl) or not (``skip``, veRL's ``masked_mean`` over
rows with a token)."""


class RolloutCorrectionConfig(BaseModel):
    """Train / inference mismatch correction (``relayrl.algos.rollout_correction``).

    rho = pi_trainer / pi_engine per token, the trainer's logprobs taken at the start of the
    step under the weights the engine sampled with. The weight multiplies the policy loss of
    any ``algo.policy_loss``; with ``decoupled_ppo`` a mode other than ``none`` replaces the
    behaviour weight (the same ratio) while the behaviour-weight cap still masks (``none``
    with ``reject_kl`` keeps the behaviour weight). Stats: ``rollout_corr/*``.
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )

    mode: Literal["none", "tis", "mis", "icepop"] = "none"
    """``tis``: min(rho, cap); ``mis``: rho inside [lower, upper], else 0; ``icepop``: the
    token-level band mask of IcePop; ``none``: weight 1 (stats and ``reject_kl`` only). Any
    mode other than none (or a ``reject_kl``) costs one trainer forward pass per step when the
    step would otherwise reuse the update's own logprobs."""
    level: Literal["token", "sequence"] = "token"
    """``sequence``: rho of a sequence = product of its token ratios (icepop: token only)."""
    cap: float | None = Field(2.0, gt=1)
    """TIS truncation (null: no cap, the plain importance weight)."""
    lower: float | None = Field(0.5, gt=0, lt=1)
    """MIS / IcePop band, lower end (null: open)."""
    upper: float | None = Field(2.0, gt=1)
    """MIS / IcePop band, upper end (null: open). IcePop's paper uses [0.5, 5]."""
    batch_normalize: bool = False
    """Divide the weights by their mean over the step's kept tokens (sequences)."""
    reject_kl: float | None = Field(None, gt=0)
    """Drop (weight 0) each sequence whose KL(engine || trainer) estimate exceeds this."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_agg: Literal["mean", "sum", "max"] = "mean"
    """How a sequence's token KL estimates make its ``reject_kl`` statistic."""
    mismatch_threshold: float = Field(0.1, gt=0, le=20)
    """|trainer - engine logprob| above which a token counts in ``beyond_threshold_frac``."""

    @property
    def enabled(self) -> bool:
        """Whether weights are applied (the stats are logged whenever this is true)."""
        return self.mode != "none" or self.reject_kl is not None


class DistillConfig(BaseModel):
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv:2306.13649; Thinking Machines
    2025): a teacher scores the student's own samples token by token.

    With d_t = log pi_student(y_t) - log pi_teacher(y_t), a per-token estimate of the reverse
    KL(student || teacher) on the student's samples:
    - ``mode: reward``: the advantage of token t gets -coef * d_t (discount 0: each token is
      pushed towards the teacher on its own), added to the task advantage, or alone with
      ``task_reward: false``;
    - ``mode: loss``: the loss gets coef * agg(0.5 d_t^2) (k2, whose on-policy gradient is
      E[d_t grad log pi_student], the reverse-KL gradient).
    The teacher must share the student's tokenizer; it runs in the controller process.
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, allow_inf_nan=False
    )

    teacher_path: str | None = None
    """Local Hugging Face teacher directory (null: no distillation)."""
    mode: Literal["reward", "loss"] = "reward"
    coef: float = Field(1.0, gt=0, le=100)
    task_reward: bool = True
    """false: the distillation signal alone (the task advantages are dropped)."""
