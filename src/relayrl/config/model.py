"""The ``model`` section: the policy's weights, LoRA and FSDP2."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from relayrl.config.base import Fraction, KeyProblem, _Strict


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
    save_merged: bool = False
    """Also write each checkpoint's actor as base + merged adapters, a plain Hugging Face
    directory ``actor_merged/`` beside the adapter (``from_pretrained`` / vLLM load it with no
    peft). Not with ``model.fsdp.enabled`` (the adapters are sharded there)."""


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
    """Critic initialisation (PPO); defaults to ``path`` (backbone of the actor + zero head).
    A reward model directory (``relayrl rm``'s output) keeps its head too, rescaled to the
    normalised score: V starts as the reward model's (r - mean) / std (InstructGPT's init)."""
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

    @model_validator(mode="after")
    def _merged_export(self) -> ModelConfig:
        if self.lora is not None and self.lora.save_merged and self.fsdp.enabled:
            raise KeyProblem(
                "lora.save_merged",
                True,
                "needs the whole actor in one process; with model.fsdp.enabled its adapters "
                "are sharded (merge the adapter checkpoint afterwards)",
                related=("fsdp.enabled",),
            )
        return self
