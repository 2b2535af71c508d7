"""The ``algo`` section: the algorithm, its losses and advantages, and its sub-sections
(``algo.rollout_correction``, ``algo.distill``).

Cross-field checks of the sub-sections live in ``AlgoConfig._cross_checks``, which names the
key in its error.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.config.base import (
    GROUP_ADVANTAGES,
    BehavWeightMode,
    KeyProblem,
    _Strict,
)

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


class AlgoConfig(_Strict):
    name: Literal["grpo", "ppo", "dpo"] = "grpo"
    """``dpo``: offline DPO on preference pairs (``data.train_path``), beta = ``kl_coef``."""
    advantage: str | None = None
    """Advantage estimator; defaults to ``grpo`` for GRPO and ``gae`` for PPO."""
    turn_credit: Literal["none", "stepwise_grpo"] = "none"
    """Multi-turn episodes under GRPO: ``stepwise_grpo`` gives each assistant turn its own
    advantage, its discounted return (per-turn rewards, the score on the last turn)
    normalised over its group at that turn (``relayrl.algos.turn_credit``); ``none``: one
    advantage per episode."""
    turn_gamma: float = Field(1.0, ge=0, le=1)
    """Discount over turns of ``turn_credit: stepwise_grpo``."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt; the group-relative advantages (``GROUP_ADVANTAGES``) need >= 2."""
    prompts_per_step: int = Field(64, ge=1)
    epochs: int = Field(1, ge=1)
    mini_batches: int = Field(2, ge=1)
    micro_batch_size: int = Field(64, ge=1)
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Dynamic micro-batches (veRL ``use_dynamic_bsz``): rows sorted by length and packed up
    to this many padded tokens each (at most ``micro_batch_size`` rows). Every micro-batch is
    trimmed to its own longest response either way."""
    recompute_old_logprobs: Literal["auto", "always"] = "auto"
    """``auto``: with one policy update per step (epochs = mini_batches = 1) the GRPO actor
    takes pi_old = its own detached logprobs in the update's forward (identical values, one
    forward pass fewer; as veRL does on-policy). ``always``: a separate forward first."""
    skip_zero_advantage: bool = True
    """Leave sequences whose advantages are all 0 (GRPO groups where every answer scored the
    same) out of the actor's forward/backward. Exact: their policy-loss gradient is 0 and the
    loss normaliser still counts them. Only when the loss has no other per-token term
    (GRPO KL loss with ``kl_coef > 0`` or ``entropy_coef != 0`` turn it off by themselves)."""
    loss_agg: Literal[
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "token-sum",
    ] = "token-mean"
    """GSPO / GMPO / SAPO as in their papers (and veRL, which forces it): seq-mean-token-mean."""
    seq_mean_empty_rows: EmptyRows = "count"
    """seq-mean-* denominators: every row of the step (relayrl) or ``skip`` empty ones (veRL)."""
    policy_loss: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """A loss registered in ``relayrl.algos.registry`` (checked before the run starts):
    ``ppo`` (clip centred on pi_old), ``decoupled_ppo`` (AReaL), a 2025 loss (``gspo``,
    ``gspo_token``, ``cispo``, ``sapo``, ``gmpo``) or one of your own. Default: ``ppo`` for
    the sync schedule, ``decoupled_ppo`` for overlap and async (off-policy correction on).
    The 2025 losses are centred on the recomputed pi_old in every schedule; off the sync
    schedule they get decoupled PPO's behaviour weight (``behav_weight_*``), replaced by
    ``algo.rollout_correction`` when set."""
    clip_eps_low: float = Field(0.2, gt=0, lt=1)
    """The ratio is clipped below at 1 - clip_eps_low, so it must stay in (0, 1)."""
    clip_eps_high: float = Field(0.2, gt=0, le=10)
    """Clip above at 1 + clip_eps_high (DAPO: 0.28); at most 10 (beyond, nothing clips)."""
    dual_clip: float | None = Field(None, gt=1)
    """Dual-clip PPO's bound on the loss of negative-advantage tokens (> 1; null: off)."""
    behav_weight_cap: float | None = Field(5.0, gt=1)
    """Decoupled PPO: tokens whose behaviour weight exceeds it are left out (> 1: on-policy
    tokens have weight 1; null: no cap)."""
    behav_weight_mode: BehavWeightMode = "token-mask"
    """What the cap does (AReaL's modes): zero the weight above it (mask), min(w, cap)
    (truncate), clamp(w, lower, cap) (clamp); sequence-*: w = geometric mean per sequence."""
    behav_weight_lower: float | None = Field(None, gt=0, lt=1)
    """Lower end of the clamp modes (null: 1 / behav_weight_cap)."""
    sapo_tau_pos: float = Field(1.0, gt=0, le=100)
    """SAPO gate temperature for A > 0 (veRL's default)."""
    sapo_tau_neg: float = Field(1.05, gt=0, le=100)
    """SAPO gate temperature for A <= 0."""
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """On-policy distillation from ``distill.teacher_path`` (GRPO-style runs)."""
    kl_coef: float = Field(0.0, ge=0)
    """beta of the KL to the frozen reference, where ``algo.kl_in`` puts it: the weight of the
    KL loss term (GRPO's default) or of the KL penalty in the token rewards (PPO's default)."""
    kl_in: Literal["reward", "loss"] | None = None
    """Where the KL to the reference goes (veRL's ``algorithm.use_kl_in_reward`` /
    ``actor.use_kl_loss``). ``reward``: r_t = -beta * KL_t(pi_old || pi_ref) on every response
    token plus the score on the last one (PPO: GAE over them; GRPO-style advantages: the
    sequence return sum_t r_t = score - beta * sum_t KL_t is what the group normalises).
    ``loss``: the actor loss gets + beta * agg(KL_t(pi_theta || pi_ref)), aggregated by
    ``algo.loss_agg``, and the rewards carry no KL. null: ``reward`` for PPO, ``loss`` for
    the others."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] | None = None
    """Defaults to k1 for a KL in the reward and k3 for a KL loss term (veRL's defaults)."""
    adaptive_kl_target: float | None = Field(None, gt=0)
    """Adaptive KL: the per-token KL (nats per token, as ``adaptive_kl_metric`` averages it)
    that beta is steered towards, wherever ``algo.kl_in`` puts it (null: fixed); not a
    sequence's summed KL (Ziegler et al.'s target of 6 nats is per sample: divide it by the
    response length). A KL in the loss feeds the controller the update's token mean."""
    adaptive_kl_horizon: int = Field(10000, ge=1)
    adaptive_kl_metric: Literal["token-mean", "seq-mean"] = "token-mean"
    """The KL fed to the adaptive controller: mean over the step's tokens (relayrl) or mean of
    per-sequence means (veRL; a KL in the reward only)."""
    missing_eos_penalty: float | None = Field(None, ge=0)
    """Subtracted from the score of each response cut at ``rollout.max_tokens`` (finish
    reason ``length``: no EOS or stop token) before advantages, every RL algorithm (TRL's
    ``missing_eos_penalty``); null: off. Metric ``missing_eos/penalised`` (how many per step);
    ``pass_rate`` keeps the raw outcome."""
    singleton_advantage: Literal["zero", "score"] = "zero"
    """A group of one (grpo, drgrpo, reinforce_plus_plus_baseline): advantage 0, or its raw
    score as veRL (group mean 0, std 1)."""
    rfpp_baseline_target: Literal["return", "score"] = "return"
    """REINFORCE++-baseline: return-to-go minus group mean (relayrl) or score minus group mean
    (veRL); equal with gamma = 1 and an outcome reward only."""
    entropy_coef: float = 0.0
    """Entropy bonus weight; any finite number (negative penalises entropy)."""
    norm_by_std: bool = True
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    whiten_advantages: bool = True
    vf_coef: float = Field(0.5, ge=0)
    vf_clip: float = Field(0.2, gt=0)
    critic_warmup_steps: int = Field(0, ge=0)
    """PPO: the first N steps train the critic only (the actor is not updated), so the policy's
    first updates see a critic fitted to its returns, not a fresh head (veRL's
    ``trainer.critic_warmup``; 0: off)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> AlgoConfig:
        if self.distill.teacher_path is not None and self.name != "grpo":
            raise KeyProblem(
                "distill.teacher_path",
                self.distill.teacher_path,
                f"on-policy distillation runs with algo.name 'grpo' (GRPO-style advantages, "
                f"with or without the task reward); {self.name!r} does not read algo.distill",
                related=("name",),
            )
        if self.name == "dpo":
            if self.kl_in is not None:
                raise KeyProblem(
                    "kl_in",
                    self.kl_in,
                    "algo.name 'dpo' has no reward or policy-gradient loss to put a KL in: "
                    "algo.kl_coef is DPO's beta; leave algo.kl_in unset",
                    related=("name",),
                )
            if self.missing_eos_penalty is not None:
                raise KeyProblem(
                    "missing_eos_penalty",
                    self.missing_eos_penalty,
                    "algo.name 'dpo' trains on fixed preference pairs, it samples no response "
                    "to penalise; leave algo.missing_eos_penalty unset",
                    related=("name",),
                )
            if self.kl_coef <= 0:
                raise KeyProblem(
                    "kl_coef",
                    self.kl_coef,
                    "algo.name 'dpo' needs algo.kl_coef > 0 (DPO's beta), e.g. 0.1",
                    related=("name",),
                )
            return self
        if self.turn_credit != "none" and (self.name != "grpo" or self.group_size < 2):
            raise KeyProblem(
                "turn_credit",
                self.turn_credit,
                "normalises each turn over its group: it needs algo.name=grpo and "
                "algo.group_size >= 2",
                related=("name", "group_size"),
            )
        if self.advantage_name in GROUP_ADVANTAGES and self.group_size < 2:
            raise KeyProblem(
                "group_size",
                self.group_size,
                f"the {self.advantage_name!r} advantage needs >= 2 samples per prompt: it "
                "compares each sample with the others of its group, so with one every "
                "advantage is 0 (one sample per prompt: algo.name=ppo)",
                related=("name", "advantage"),
            )
        rows = self.prompts_per_step * self.group_size
        if self.mini_batches > rows:
            raise KeyProblem(
                "mini_batches",
                self.mini_batches,
                f"more mini-batches than the {rows} sequences of a step "
                "(algo.prompts_per_step * algo.group_size)",
                related=("prompts_per_step", "group_size"),
            )
        if self.dual_clip is not None and self.policy_loss in ("cispo", "sapo", "gmpo"):
            raise KeyProblem(
                "dual_clip",
                self.dual_clip,
                f"dual clip is not defined for policy_loss {self.policy_loss!r}",
                related=("policy_loss",),
            )
        rc = self.rollout_correction  # (lower < 1 < upper by their ranges)
        if rc.mode == "icepop" and rc.level != "token":
            raise KeyProblem(
                "rollout_correction.level", rc.level, "icepop masks tokens: use level token"
            )
        if self.critic_warmup_steps and self.name != "ppo":
            raise KeyProblem(
                "critic_warmup_steps",
                self.critic_warmup_steps,
                "trains the critic alone for the first steps: it needs algo.name=ppo (a critic)",
                related=("name",),
            )
        self._kl_checks()
        if self.adaptive_kl_target is not None and self.kl_coef == 0:
            raise KeyProblem(
                "kl_coef",
                self.kl_coef,
                "algo.adaptive_kl_target scales the KL coefficient multiplicatively from "
                "algo.kl_coef, so it must start > 0",
                related=("adaptive_kl_target",),
            )
        return self

    def _kl_checks(self) -> None:
        """``algo.kl_in`` against the keys it meets (DPO returned earlier)."""
        if self.kl_in == "reward":
            if self.turn_credit != "none":
                raise KeyProblem(
                    "kl_in",
                    self.kl_in,
                    f"algo.turn_credit={self.turn_credit} builds its advantages from the "
                    "turns' scores, not from token rewards: a KL in the reward would be "
                    "dropped; use algo.kl_in=loss",
                    related=("turn_credit",),
                )
            d = self.distill
            if d.teacher_path is not None and d.mode == "reward" and not d.task_reward:
                raise KeyProblem(
                    "kl_in",
                    self.kl_in,
                    "algo.distill.task_reward=false drops the task advantages, and with them a "
                    "KL in the reward; use algo.kl_in=loss",
                    related=("distill.task_reward",),
                )
        if (
            self.adaptive_kl_target is not None
            and self.kl_placement == "loss"
            and self.adaptive_kl_metric == "seq-mean"
        ):
            raise KeyProblem(
                "adaptive_kl_metric",
                self.adaptive_kl_metric,
                "a KL loss term feeds the adaptive controller the update's token mean; "
                "seq-mean needs the KL in the reward (algo.kl_in=reward)",
                related=("kl_in", "adaptive_kl_target"),
            )

    @property
    def advantage_name(self) -> str:
        return self.advantage or ("gae" if self.name == "ppo" else "grpo")

    @property
    def kl_placement(self) -> Literal["reward", "loss"]:
        """Where the KL to the reference goes: ``algo.kl_in``, else ``reward`` for PPO and
        ``loss`` for the GRPO-style algorithms."""
        if self.kl_in is not None:
            return self.kl_in
        return "reward" if self.name == "ppo" else "loss"

    @property
    def kl_kind(self) -> str:
        return self.kl_estimator or ("k1" if self.kl_placement == "reward" else "k3")
