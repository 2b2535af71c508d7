"""Write docs/config.md from the config schema: every key, its type, default, range and meaning.

The schema is the pydantic models of ``relayrl.config`` (``relayrl train`` / ``eval``),
``SFTConfig`` (``relayrl sft``) and ``RMConfig`` (``relayrl rm``). A key's meaning is the
docstring under its field in the source (the attribute docstring); a key without one takes its
line from ``MEANINGS`` below, and a key with neither fails the run (and
``tests/repo/test_config_docs.py``), so a new key cannot go undocumented. When the config becomes a
package (issue 40 item 6), these lines move into docstrings beside their fields.

    python tools/config_docs.py            # rewrite docs/config.md
    python tools/config_docs.py --check    # exit 1 when docs/config.md is not current
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "config.md"

# The meaning of each key whose field has no docstring, by ``Schema.field`` (the class that
# declares it). Taken from the README's hand-written table where it had the key.
MEANINGS: dict[str, str] = {
    "RunConfig.seed": "Seeds prompts, sampling (per request) and shuffling.",
    "RunConfig.run_dir": "Metrics, config copy, TensorBoard, checkpoints.",
    "RunConfig.cluster": "``local``: processes on this machine; ``ray``: Ray actors (``ray.*``).",
    "RunConfig.ray": "Where each role runs under ``cluster: ray``.",
    "RunConfig.model": "The policy model: path, dtype, device, LoRA, FSDP2.",
    "RunConfig.data": "Prompts: the task or files, held-out evaluation, filtering.",
    "RunConfig.reward": "The reward: a function, a reward model, or a scoring service.",
    "RunConfig.algo": "The algorithm: advantages, policy loss, KL, batching.",
    "RunConfig.optim": "AdamW and its schedule.",
    "RunConfig.rollout": "Sampling and the generation engine.",
    "RunConfig.async": "Overlap / async schedules: staleness bound and interruption.",
    "RunConfig.train": "Steps, evaluation and checkpoint cadence.",
    "RunConfig.logging": "Metrics backends and progress output.",
    "RunConfig.eval": "The held-out evaluation (in training and ``relayrl eval``).",
    "RunConfig.monitor": "Run monitors (proxy-vs-gold reward, diversity).",
    "RunConfig.env": "Multi-turn environments and agents.",
    "RunConfig.weight_sync": "How weights move from the trainer to the rollout engines.",
    "AlgoConfig.prompts_per_step": "Prompts per training step.",
    "AlgoConfig.epochs": "Passes over a step's batch.",
    "AlgoConfig.mini_batches": "Optimizer steps per pass (the batch split into this many).",
    "AlgoConfig.micro_batch_size": "Sequences per forward/backward (gradient accumulation).",
    "AlgoConfig.rollout_correction": "Train / inference mismatch correction.",
    "AlgoConfig.adaptive_kl_horizon": "Adaptive KL (Ziegler et al.): the controller's horizon.",
    "AlgoConfig.norm_by_std": "GRPO: divide by the group's std (false: Dr.GRPO).",
    "AlgoConfig.gamma": "GAE discount.",
    "AlgoConfig.lam": "GAE lambda.",
    "AlgoConfig.whiten_advantages": "Whiten GAE advantages over the batch.",
    "AlgoConfig.vf_coef": "Value-loss weight (PPO critic).",
    "AlgoConfig.vf_clip": "Value-loss clip range around the old values.",
    "OptimConfig.lr": "AdamW learning rate of the actor.",
    "OptimConfig.critic_lr": "AdamW learning rate of the critic.",
    "OptimConfig.weight_decay": "AdamW weight decay.",
    "OptimConfig.betas": "AdamW (beta1, beta2).",
    "OptimConfig.warmup_steps": "Linear learning-rate warmup steps.",
    "RolloutConfig.temperature": "Sampling temperature (behaviour logprobs use the same "
    "distribution).",
    "RolloutConfig.top_p": "Nucleus sampling (1: off).",
    "RolloutConfig.top_k": "Top-k sampling (0: off).",
    "RolloutConfig.max_tokens": "Response length limit in tokens.",
    "RolloutConfig.max_slots": "Concurrent sequences in the engine.",
    "AsyncConfig.stale_weight": "Advantage multiplier of an over-stale token under "
    "``stale_tokens: downweight``.",
    "AsyncConfig.poll_interval_s": "How often the async trainer polls for finished groups.",
    "TrainConfig.keep_checkpoints": "Newest checkpoints kept.",
    "LoggingConfig.progress": "Progress bar (a terminal) or progress lines (otherwise).",
    "RayPoolConfig.bundles": "Bundles (one worker process each) of the pool.",
    "RayPoolConfig.cpus_per_bundle": "CPUs of each bundle.",
    "RayPoolConfig.gpus_per_bundle": "GPUs of each bundle.",
    "RayPoolConfig.strategy": "Ray placement-group strategy.",
    "RayConfig.pools": "Resource pools by name (Ray placement groups).",
    "SFTConfig.seed": "Seeds data generation, shuffling and initialisation.",
    "SFTConfig.threads": "torch threads; ``auto``: the CPUs idle at start.",
    "SFTConfig.model_path": "Local Hugging Face model directory to fine-tune.",
    "SFTConfig.output_dir": "Where the fine-tuned model is saved.",
    "SFTConfig.task": "``arithmetic`` (built in) or ``jsonl`` (``train_path``).",
    "SFTConfig.arithmetic": "The arithmetic task's problems.",
    "SFTConfig.num_examples": "Training examples generated for the arithmetic task.",
    "SFTConfig.steps": "Optimizer steps.",
    "SFTConfig.batch_size": "Sequences per optimizer step.",
    "SFTConfig.lr": "AdamW learning rate.",
    "SFTConfig.warmup_steps": "Linear warmup steps.",
    "SFTConfig.val_reward": "Reward that scores the validation answers (a registered name or "
    "``module:function``).",
    "SFTConfig.eval_size": "Validation prompts per evaluation.",
    "SFTConfig.weight_decay": "AdamW weight decay.",
    "SFTConfig.grad_clip": "Gradient-norm clip (null: off).",
    "SFTConfig.progress": "Progress bar / lines.",
    "ModelConfig.fsdp": "FSDP2 sharding over the data-parallel ranks.",
    "ArithmeticConfig.max_operand": "Inclusive upper end of the operand range.",
    "ArithmeticConfig.operators": "Operators drawn from (``+``, ``-``, ``*``).",
    "ArithmeticConfig.num_operands": "Operands per problem.",
    "DataConfig.task": "``arithmetic`` (built in) or ``jsonl`` (``train_path``, or Parquet / a "
    "saved ``datasets`` directory).",
    "DataConfig.arithmetic": "The built-in arithmetic task: operand range, operators, operand "
    "count.",
    "DataConfig.eval_size": "Held-out problems for the greedy eval (never trained on).",
    "DataConfig.max_prompt_tokens": "Longer prompts are skipped and counted.",
    "DataConfig.source": "How dataset rows become prompts (keys, split, chat template).",
    "DataConfig.dynamic_sampling": "DAPO dynamic sampling.",
    "PromptSourceConfig.prompt_key": "The row field that holds the prompt.",
    "PromptSourceConfig.answer_key": "The row field that holds the reference answer.",
    "PromptSourceConfig.system_prompt": "A system message put before every prompt (chat "
    "template only; null: none).",
    "DynamicSamplingConfig.enabled": "Drop groups whose raw outcomes are all equal and refill "
    "(needs ``algo.group_size`` >= 2).",
    "RewardConfig.model_weight": "Weight of the reward model's score in the sum.",
    "RewardConfig.model_batch_size": "Sequences per reward-model forward.",
    "RewardConfig.service": "The reward service: mixture, worker processes, timeouts.",
    "RewardServiceConfig.timeout_s": "Seconds a reward call may take before it is a recorded "
    "failure (worker processes only).",
    "RewardServiceConfig.max_pending": "Most samples being scored at once (null: no limit).",
    "RewardServiceConfig.failure_score": "The score of a sample whose reward call failed.",
    "RewardServiceConfig.domain_key": "The row field that names a sample's domain "
    "(``normalize: domain_zscore``).",
    "RolloutCorrectionConfig.kl_estimator": "The per-token KL estimator of the ``reject_kl`` "
    "statistic.",
    "DistillConfig.mode": "``reward``: -coef * d_t added to each token's advantage; ``loss``: "
    "coef * the k2 distance as a loss term.",
    "DistillConfig.coef": "Weight of the distillation signal.",
    "EvalConfig.temperature": "Sampling temperature when not greedy.",
    "EvalConfig.top_p": "Nucleus sampling when not greedy (1: off).",
    "WeightSyncConfig.transport": "``object_store``: through Ray's object store; ``collective``: "
    "a broadcast over a process group of the trainer's rank 0 and the replicas.",
    "RMConfig.seed": "Seeds the hold-out split, shuffling and the head's initialisation.",
    "RMConfig.threads": "torch threads; ``auto``: the CPUs idle at start.",
    "RMConfig.output_dir": "Where the reward model is saved (a one-label "
    "``AutoModelForSequenceClassification``).",
    "RMConfig.eval_fraction": "Share of ``train_path`` held out when ``eval_path`` is unset.",
    "RMConfig.epochs": "Passes over the training pairs (fractions allowed).",
    "RMConfig.batch_size": "Pairs per optimizer step.",
    "RMConfig.micro_batch_size": "Sequences per forward/backward.",
    "RMConfig.lr": "AdamW learning rate.",
    "RMConfig.weight_decay": "AdamW weight decay.",
    "RMConfig.warmup_steps": "Linear warmup steps.",
    "RMConfig.grad_clip": "Gradient-norm clip (null: off).",
    "RMConfig.dtype": "Parameter and compute dtype.",
    "RMConfig.progress": "Progress bar / lines.",
    "RMConfig.tensorboard": "Write TensorBoard scalars to ``output_dir``.",
}

_BOUNDS = ((at.Ge, "ge", ">="), (at.Gt, "gt", ">"), (at.Le, "le", "<="), (at.Lt, "lt", "<"))


def _doc_lines(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of the attribute docstrings in ``cls``'s own source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    out: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return out


def _model_in(tp: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``X``, ``X | None``; else None."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        models = [a for a in typing.get_args(tp) if _model_in(a)]
        return _model_in(models[0]) if len(models) == 1 else None
    return None


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is tuple:
        return "(" + ", ".join(_type_name(a) for a in args) + ")"
    if origin is dict:
        return f"map {_type_name(args[0])} -> {_type_name(args[1])}"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _range(info: FieldInfo) -> str:
    """``>= 1``, ``> 0, <= 10``, ... from the field's constraints (those of an ``Annotated``
    alias like ``Fraction`` included; each element of a tuple of them too)."""
    metadata = list(info.metadata)
    for arg in typing.get_args(info.annotation):
        metadata += typing.get_args(arg)[1:] if typing.get_origin(arg) is typing.Annotated else []
    while any(isinstance(m, FieldInfo) for m in metadata):  # ``Field(ge=0)`` inside Annotated
        metadata = [x for m in metadata for x in (m.metadata if isinstance(m, FieldInfo) else [m])]
    parts = []
    for m in metadata:
        for kind, attr, op in _BOUNDS:
            if isinstance(m, kind):
                parts.append(f"{op} {getattr(m, attr)}")
        if isinstance(m, at.MinLen):
            parts.append(f"length >= {m.min_length}")
    if typing.get_origin(info.annotation) is tuple and parts:
        parts = [f"each {p}" for p in dict.fromkeys(parts)]
    return ", ".join(dict.fromkeys(parts))


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
    elif info.default is PydanticUndefined:
        return "(required)"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, dict) and any(isinstance(v, BaseModel) for v in value.values()):
        value = {k: v.model_dump() for k, v in value.items()}
    return json.dumps(value, default=str)


def rows(
    schema: type[BaseModel], prefix: str = "", missing: list[str] | None = None
) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, range, meaning) of every key of ``schema``, sections recursed;
    a key without a meaning is added to ``missing`` (an error when it is not given)."""
    top = missing is None
    missing = [] if missing is None else missing
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseModel) and cls is not BaseModel:
            docs.update(_doc_lines(cls))
    out = []
    for name, info in schema.model_fields.items():
        key = info.alias or name
        owner = next(c for c in schema.__mro__ if name in getattr(c, "__annotations__", {}))
        meaning = docs.get(name) or MEANINGS.get(f"{owner.__name__}.{key}", "")
        if not meaning:
            missing.append(f"{prefix}{key} ({owner.__name__}.{key})")
        sub = _model_in(info.annotation)
        if sub is not None and _default(info) == "":  # a section that is always there
            out.append((f"{prefix}{key}", "section", "", "", meaning))
            out += rows(sub, f"{prefix}{key}.", missing)
            continue
        out.append(
            (f"{prefix}{key}", _type_name(info.annotation), _default(info), _range(info), meaning)
        )
        if sub is not None:  # an optional section (``model.lora``): its keys once set
            out += rows(sub, f"{prefix}{key}.", missing)
        elif typing.get_origin(info.annotation) is dict:
            value = typing.get_args(info.annotation)[1]
            if _model_in(value) is not None:
                out += rows(value, f"{prefix}{key}.<name>.", missing)
    if top and missing:
        raise SystemExit(
            "keys without a meaning (give each field a docstring, or a line in "
            "tools/config_docs.py's MEANINGS):\n" + "\n".join(missing)
        )
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if "\\|" not in text else text


def render() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from relayrl.config import RunConfig, SFTConfig
    from relayrl.controller.rm_training import RMConfig

    lines = [
        "# Config reference (generated)",
        "",
        "<!-- Generated by tools/config_docs.py from the config schema; do not edit by hand:",
        "     run `python tools/config_docs.py` (tests/repo/test_config_docs.py checks it). -->",
        "",
        "Every key of every config, with its type, default, range and meaning, in the order of",
        "the schema. Set a key in the YAML file (`algo: {kl_coef: 0.05}`) or on the command line",
        "with its dotted name (`algo.kl_coef=0.05`). A section's keys follow the section's row;",
        "`<name>` stands for a name you choose (a Ray pool). Floats must be finite; an unbounded",
        "option is `null`. The keys most runs change, with practical notes, are in",
        "[reference.md](reference.md).",
        "",
    ]
    for title, command, schema in (
        ("Run config", "`relayrl train`, `relayrl eval`, `relayrl filter`", RunConfig),
        ("SFT config", "`relayrl sft`", SFTConfig),
        ("Reward-model config", "`relayrl rm`", RMConfig),
    ):
        lines += [f"## {title} ({command})", "", "| key | type | default | range | meaning |"]
        lines.append("|---|---|---|---|---|")
        for key, tp, default, rng, meaning in rows(schema):
            default = f"`{default}`" if default else ""
            lines.append(f"| `{key}` | {_cell(tp)} | {_cell(default)} | {rng} | {_cell(meaning)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/config.md is stale")
    args = p.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python tools/config_docs.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}: {text.count(chr(10) + '| `')} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
