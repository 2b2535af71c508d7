"""Run-config sections for the model, data, reward and run monitors.

A leaf beside ``relayrl.config`` (which re-exports every name); split from it to keep each file
to one idea.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from relayrl.config_base import Fraction, KeyProblem, _Strict


class LoraConfig(_Strict):
    """LoRA adapters through ``peft`` (``relayrl.model.lora``): only the adapters train."""

    r: int = Field(8, ge=1)
    """Rank of each adapter pair (A: r x in, B: out x r)."""
    alpha: float = Field(16.0, gt=0)
    """Scale: the update is ``alpha / r * B @ A``."""
    dropout: Fraction = 0.0
    """Dropout on the adapter input (0 keeps the training forward equal to the rollout's)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1
    )
    """Module names (suffixes) that get adapters, as ``peft.LoraConfig.target_modules``."""


class FsdpConfig(_Strict):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) over the data-parallel ranks."""

    enabled: bool = False
    """Shard parameters, gradients and optimizer state of actor, critic and reference over the
    ranks of the role's pool (gloo on CPU, NCCL on CUDA); off: every rank holds a replica."""
    reshard_after_forward: bool = True
    """Free the gathered parameters of a layer after its forward (ZeRO-3); off: keep them
    until the backward (ZeRO-2, one all-gather less per layer)."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and optimizer state in CPU memory."""
    sync_bucket_mb: float = Field(256.0, gt=0)
    """Weight sync: gather full tensors into buckets of at most this size (bounded memory)."""


class ModelConfig(_Strict):
    path: str = "runs/demo/sft"
    """Local Hugging Face model directory (config.json + weights + tokenizer)."""
    critic_path: str | None = None
    """Critic initialisation (PPO); defaults to ``path`` (backbone of the actor + zero head)."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Compute dtype of the forwards. ``bfloat16`` with ``mixed_precision`` trains fp32 master
    weights (fp32 optimizer state) under bf16 autocast; logprobs, losses and advantages are
    fp32 (float64 with ``float64``) whatever this is."""
    mixed_precision: bool = True
    """With ``dtype: bfloat16``: fp32 master weights and optimizer state of trainable roles
    (off: parameters and Adam moments in bf16, the old pure-bf16 behaviour)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the roles' models run: ``auto`` = CUDA when available, else the CPU; data-parallel
    rank r of a node uses local CUDA device ``r % device_count``."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward (HF gradient checkpointing,
    non-reentrant): less activation memory for about one more forward of compute."""
    lora: LoraConfig | None = None
    """LoRA adapters on the actor (null: full fine-tuning); the reference is then the actor
    with its adapters disabled (no second copy of the weights)."""
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)


class ArithmeticConfig(_Strict):
    min_operand: int = 0
    """Inclusive operand range; negative operands are allowed (written ``(-3)``)."""
    max_operand: int = 99
    operators: list[str] = Field(default_factory=lambda: ["+"])
    num_operands: int = Field(2, ge=2)

    @model_validator(mode="after")
    def _range_not_empty(self) -> ArithmeticConfig:
        if self.max_operand < self.min_operand:
            raise KeyProblem(
                "max_operand",
                self.max_operand,
                f"must be >= min_operand ({self.min_operand})",
                related=("min_operand",),
            )
        return self


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
    """Held-out prompts (the first ``eval_size``). Unset: ``task: jsonl`` holds out
    ``eval_size`` seeded prompts of ``train_path``, never trained on (at most half of it);
    ``task: arithmetic`` uses a disjoint seeded stream."""
    eval_size: int = Field(200, ge=1)
    max_prompt_tokens: int = Field(128, ge=1)
    source: PromptSourceConfig = Field(default_factory=PromptSourceConfig)
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)


class RewardFnConfig(_Strict):
    """One weighted reward function of a mixture."""

    fn: str
    weight: float = 1.0
    """Any finite number (a negative weight makes the component a penalty)."""
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
    worker_max_calls: int | None = Field(5000, ge=1)
    """Replace a reward worker after this many calls (null: never)."""
    worker_max_rss_mb: float | None = Field(1024.0, gt=0)
    """Replace a reward worker whose resident memory exceeds this after a call (null: never)."""
    max_components: int = Field(64, ge=1)
    """Most components a sample's reward may have; more is a recorded failure."""


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
    fn_timeout_s: float | None = Field(300.0, gt=0)
    """Seconds one inline call of ``fn`` may take (null: no limit). A call past it ends the run
    in one line after checkpointing the last completed step (the reward service's workers have
    their own ``service.timeout_s``)."""
    service: RewardServiceConfig = Field(default_factory=RewardServiceConfig)


class MonitorConfig(_Strict):
    gold_fn: str | None = None
    """A gold / held-out scorer (reward function spec) evaluated on every step's samples to
    log proxy-vs-gold divergence (``monitor/*``); KL and distinct-n are logged regardless."""
