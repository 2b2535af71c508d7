"""Actor and reference roles: per-token logprobs, and the actor's policy update.

One class each whatever the parallelism: a worker holds a ``Parallelism`` strategy
(``relayrl.workers.parallel``: one process, replicated data parallel, FSDP2) for everything
that differs between them, and the actor an optional ``LoraOption`` (``relayrl.workers.lora``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from relayrl.algos import LossNorm, PolicyLossInputs, aggregate_loss, get_policy_loss, kl_penalty
from relayrl.algos.masked import deferred_stats, host_floats
from relayrl.config import AlgoConfig, OptimConfig, RunConfig
from relayrl.model import forward_logprobs
from relayrl.model.batching import output_dtype
from relayrl.model.device import model_device
from relayrl.model.loading import has_train_dropout
from relayrl.model.lora import adapters_disabled, is_lora
from relayrl.workers.experience import Experience
from relayrl.workers.lora import LoraOption
from relayrl.workers.optim import load_train_state, make_optimizer, train_state
from relayrl.workers.parallel import (
    Parallelism,
    SingleProcess,
    clip_and_step,
    count_micro_batches,
)


class ReferenceWorker:
    """A frozen policy: computes log pi_ref of response tokens.

    ``parallelism``: how it runs over processes (default one process); ``adapters_off``: the
    forwards run with the model's LoRA adapters disabled (the reference of a LoRA actor);
    ``frozen`` False: the model is another role's, its modes and trainable flags untouched.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        micro_batch_size: int,
        temperature: float = 1.0,
        micro_batch_tokens: int | None = None,
        parallelism: Parallelism | None = None,
        adapters_off: bool = False,
        frozen: bool = True,
    ):
        self.model = model
        if frozen:
            self.model.eval().requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.parallelism = parallelism if parallelism is not None else SingleProcess()
        self.adapters_off = adapters_off

    @classmethod
    def from_config(
        cls, model: torch.nn.Module, cfg: RunConfig, parallelism: Parallelism | None = None
    ) -> ReferenceWorker:
        """The frozen reference of a run: micro-batching and temperature from ``cfg``."""
        a = cfg.algo
        temperature = cfg.rollout.temperature
        return cls(model, a.micro_batch_size, temperature, a.micro_batch_tokens, parallelism)

    @classmethod
    def adapters_disabled_of(cls, actor: ActorWorker) -> ReferenceWorker:
        """pi_ref of a LoRA actor: the actor's own model (and parallelism: FSDP2 pads the same
        model's forwards) with the adapters disabled, without a second copy of the base;
        micro-batching and temperature are the actor's (``algo.micro_batch_*``,
        ``rollout.temperature``)."""
        return cls(
            actor.model,
            actor.micro_batch_size,
            actor.temperature,
            actor.micro_batch_tokens,
            actor.parallelism,
            adapters_off=True,
            frozen=False,
        )

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over ranks (FSDP2): gathers and checkpoints are
        collectives of every rank."""
        return self.parallelism.sharded

    @torch.no_grad()
    def compute_logprobs(self, exp: Experience) -> Tensor:
        """log pi(token) of every response token, 0 elsewhere (eval mode, micro-batched)."""
        size, tokens = self.micro_batch_size, self.micro_batch_tokens
        self.parallelism.plan_forwards(self.model, lambda: count_micro_batches(exp, size, tokens))
        off = adapters_disabled(self.model) if self.adapters_off else contextlib.nullcontext()
        with off:
            was_training = self.model.training
            self.model.eval()
            dev = model_device(self.model)  # logprobs stay there until the whole batch is done
            parts = [
                (idx, forward_logprobs(self.model, mb.to(dev).batch, self.temperature)[0])
                for idx, mb in exp.micro_batches(size, tokens)
            ]
            self.model.train(was_training)
        self.parallelism.pad_forwards(self.model, backward=False)  # the same collectives
        home = exp.response_mask.device
        logprobs = exp.scatter_tokens(parts, output_dtype(self.model))  # 0 rows: no parts
        return logprobs.to(home) * exp.response_mask  # one transfer


_PER_STEP = frozenset({"loss", "grad_norm"})
"""Statistics averaged over the optimizer steps, not reduced over ranks: the loss is a rank's
partial loss (normalised by the global counts: the ranks' partials add up, the worker group
sums them) and the gradient norm is already the global one."""
_WEIGHT = "weight:"
_MAX = "max:"
_MAX_SUFFIX = "_max"
"""A statistic named ``*_max`` (e.g. ``behav_weight_max``) is a maximum: the update reports its
maximum over the step's micro-batches, optimizer steps and ranks (not a token-weighted mean of
the micro-batches' maxima, which would depend on how the rows were split)."""


def _larger(old: Any, new: Any, dev: torch.device) -> Any:
    """max(old, new) of two statistics (floats or 0-d tensors; ``old`` None: ``new``),
    without a device sync."""
    if old is None:
        return new
    if isinstance(old, Tensor) or isinstance(new, Tensor):
        as64 = partial(torch.as_tensor, dtype=torch.float64, device=dev)
        return torch.maximum(as64(old), as64(new))
    return max(old, new)


class ActorWorker(ReferenceWorker):
    """The trained policy: PPO-family update with global loss normalisation per optimizer step.

    ``parallelism`` (default one process) and ``lora`` (a peft model is a LoRA actor whether
    or not it is given) as for the reference."""

    def __init__(
        self,
        model: torch.nn.Module,
        algo: AlgoConfig,
        optim: OptimConfig,
        max_response_tokens: int,
        temperature: float = 1.0,
        seed: int = 0,
        policy_loss: str = "ppo",
        parallelism: Parallelism | None = None,
        lora: LoraOption | None = None,
    ):
        super().__init__(
            model,
            algo.micro_batch_size,
            temperature,
            algo.micro_batch_tokens,
            parallelism,
            frozen=False,
        )
        self.model.eval()
        self.lora = lora if lora is not None or not is_lora(model) else LoraOption()
        if self.lora is None:  # a LoRA model trains its adapters only: peft's choice stays
            self.model.requires_grad_(True)
        self.algo = algo
        self.policy_loss = policy_loss
        self.loss_fn = get_policy_loss(policy_loss)  # registered: relayrl.algos.registry
        self.grad_clip = optim.grad_clip
        self.max_response_tokens = max_response_tokens
        self.optimizer, self.scheduler = make_optimizer(
            [p for p in model.parameters() if p.requires_grad],
            optim.lr,
            optim.weight_decay,
            optim.betas,
            optim.warmup_steps,
        )
        self.generator = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(
        cls,
        model: torch.nn.Module,
        cfg: RunConfig,
        parallelism: Parallelism | None = None,
        lora: LoraOption | None = None,
    ) -> ActorWorker:
        """The actor of a run: algorithm, optimizer, response limit, seed and loss from ``cfg``."""
        return cls(
            model,
            cfg.algo,
            cfg.optim,
            cfg.rollout.max_tokens,
            cfg.rollout.temperature,
            cfg.seed,
            cfg.policy_loss,
            parallelism,
            lora,
        )

    def train_state(self) -> dict[str, Any]:
        """Optimizer, LR scheduler and shuffling generator (a replicated role's checkpoint)."""
        return train_state(self.optimizer, self.scheduler, self.generator)

    def load_train_state(self, state: dict[str, Any]) -> None:
        load_train_state(state, self.optimizer, self.scheduler, self.generator)

    def save_sharded(self, out_dir: str) -> None:
        """A sharded (FSDP2) checkpoint of parameters, optimizer, scheduler and generator
        (``relayrl.controller.sharded_checkpoint``); every rank must call."""
        self.parallelism.save_sharded(out_dir, {"role": self})

    def load_sharded(self, in_dir: str) -> None:
        self.parallelism.load_sharded(in_dir, {"role": self})

    def update(self, exp: Experience) -> dict[str, float]:
        """Epochs x mini-batches of policy-loss steps on ``exp`` (the loss ``algo.policy_loss``
        names, looked up in ``relayrl.algos.registry``).

        Reads ``old_logprobs`` (pi_old, recomputed at the start of the step: the proximal policy),
        ``behaviour_logprobs`` (the engine's), ``advantages`` and optionally ``ref_logprobs``.
        Without ``old_logprobs`` and with a single update per step, pi_old (decoupled PPO's
        pi_prox) is the current policy itself: the update's own logprobs, detached, micro-batch
        by micro-batch (see ``single_update``), unless the model has dropout in train mode
        (``has_train_dropout``): then they are computed first, in eval mode, as a separate
        forward would (the train-mode forward's are a dropout sample, not pi_old).
        Loss = policy loss + beta * agg(KL(pi || pi_ref)) - entropy_coef * agg(H), the KL
        term with ``algo.kl_in: loss`` (beta: ``kl_coefs``, else ``algo.kl_coef``).
        """
        a = self.algo
        if exp.old_logprobs is None:
            if not self.single_update:
                raise ValueError("old_logprobs missing and the step makes more than one update")
            if has_train_dropout(self.model):
                exp = replace(exp, old_logprobs=self.compute_logprobs(exp))
        self.model.train()
        # Statistics stay on the model's device as tensors and reach the host once, at the end
        # (no device -> host sync per micro-batch or mini-batch); the Experience is cut into
        # mini- and micro-batches on the host and each micro-batch moves to the device whole.
        dev = model_device(self.model)
        sums: dict[str, Any] = defaultdict(float)
        weights: dict[str, Any] = defaultdict(float)
        maxes: dict[str, Any] = {}
        n_opt = 0
        with deferred_stats():
            for _ in range(a.epochs):
                for mini in self._mini_batches(exp):
                    n_opt += 1
                    self._train_mini(mini, dev, sums, weights, maxes)
        host = host_floats(
            {
                **sums,
                **{_WEIGHT + k: w for k, w in weights.items()},
                **{_MAX + k: m for k, m in maxes.items()},
            }
        )
        out = {
            f"actor/{k}": host.pop(k) / max(host.pop(_WEIGHT + k), 1e-12)
            for k in sorted(_PER_STEP & sums.keys())
        }
        top = {k: host.pop(k) for k in list(host) if k.startswith(_MAX)}
        # data parallel: sum_r S_r / sum_r W_r, the whole batch's mean, and max_r M_r (one
        # process: as is)
        total = self.parallelism.reduce_sums(host, top)
        for k, v in total.items():
            if k.startswith(_MAX):
                out[f"actor/{k[len(_MAX) :]}"] = v
            elif not k.startswith(_WEIGHT):
                out[f"actor/{k}"] = v / max(total[_WEIGHT + k], 1e-12)
        out["actor/lr"] = float(self.scheduler.get_last_lr()[0])
        out["actor/optimizer_steps"] = float(n_opt)
        return out

    def _train_mini(
        self,
        mini: Experience,
        dev: torch.device,
        sums: dict[str, Any],
        weights: dict[str, Any],
        maxes: dict[str, Any],
    ) -> None:
        """One optimizer step on ``mini``; its statistics added to ``sums`` / ``weights``, its
        ``*_max`` statistics taken into ``maxes`` (device tensors or floats)."""
        a = self.algo
        trained = self._rows_with_gradient(mini)
        size, tokens = a.micro_batch_size, a.micro_batch_tokens
        count = partial(count_micro_batches, trained, size, tokens)
        self.parallelism.plan_forwards(self.model, count)  # FSDP2: the ranks agree on it
        norm = self._loss_norm(mini)  # counts every row, trained or skipped
        self.optimizer.zero_grad(set_to_none=True)
        mini_loss: Any = 0.0
        sums["zero_adv_skipped_frac"] += float(len(mini) - len(trained))  # rows
        weights["zero_adv_skipped_frac"] += float(len(mini))
        if not len(trained):  # a zero gradient still moves Adam's moments
            for p in self.model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        else:
            for _, micro in trained.micro_batches(size, tokens):
                stats = self._micro_step(micro.to(dev), norm)
                mini_loss = mini_loss + stats.pop("_loss")  # partial losses add up
                n_tokens = stats.pop("_tokens")  # not ``tokens``: the micro-batch token budget
                for k, v in stats.items():
                    if k.endswith(_MAX_SUFFIX):
                        maxes[k] = _larger(maxes.get(k), v, dev)
                        continue
                    sums[k] = sums[k] + v * n_tokens
                    weights[k] = weights[k] + n_tokens
        sums["loss"] = sums["loss"] + mini_loss
        weights["loss"] += 1.0
        sums["grad_norm"] = sums["grad_norm"] + self._clip_and_step()
        weights["grad_norm"] += 1.0

    def _micro_step(self, micro: Experience, norm: LossNorm) -> dict[str, Any]:
        """Forward, loss, backward on one micro-batch: the registered policy loss
        (``algo.policy_loss``), + beta * agg(KL(pi || pi_ref)) (the KL loss term,
        ``algo.kl_in: loss``; beta = ``kl_coefs`` of the step, else ``algo.kl_coef``) + the
        distillation term - entropy_coef * agg(H)."""
        a = self.algo
        mask = micro.response_mask
        logp, ent = forward_logprobs(self.model, micro.batch, self.temperature, with_entropy=True)
        assert micro.advantages is not None
        # one update per step: pi_old = pi_theta before the update = these logprobs, detached
        old = micro.old_logprobs if micro.old_logprobs is not None else logp.detach() * mask
        inputs = PolicyLossInputs(
            logp,
            old_logprobs=old,
            behaviour_logprobs=micro.behaviour_logprobs,
            advantages=micro.advantages,
            response_mask=mask,
            norm=norm,
            token_weights=micro.rollout_weights,  # off-policy / rollout correction, constant
        )
        loss, stats = self.loss_fn(inputs, a)
        stats = {
            f"pg_{k}" if not k.startswith(("clip", "approx")) else k: v for k, v in stats.items()
        }
        if a.kl_placement == "loss" and a.kl_coef > 0 and micro.ref_logprobs is not None:
            kl = kl_penalty(logp, micro.ref_logprobs, a.kl_kind)
            kl_loss = aggregate_loss(kl, mask, norm)
            # the step's beta (adaptive KL: the controller's), else algo.kl_coef
            if micro.kl_coefs is not None:
                kl_loss = kl_loss * micro.kl_coefs[0].to(kl_loss.dtype)
            else:
                kl_loss = a.kl_coef * kl_loss
            loss = loss + kl_loss
            stats["kl"] = (kl.detach() * mask).sum() / mask.sum().clamp(min=1)
        distill = a.distill
        if distill.mode == "loss" and micro.teacher_logprobs is not None:
            # k2 = 0.5 (log pi - log pi_teacher)^2: its on-policy gradient is the reverse KL's
            d2 = kl_penalty(logp, micro.teacher_logprobs, "k2", mask)
            loss = loss + distill.coef * aggregate_loss(d2, mask, norm)
        assert ent is not None
        ent_mean = (ent.detach() * mask).sum() / mask.sum().clamp(min=1)
        if a.entropy_coef != 0:
            loss = loss - a.entropy_coef * aggregate_loss(ent, mask, norm)
        stats["entropy"] = ent_mean
        loss.backward()
        stats["_loss"] = loss.detach()
        stats["_tokens"] = mask.sum()
        return stats

    def _rows_with_gradient(self, mini: Experience) -> Experience:
        """``mini`` without the sequences whose every advantage is 0 (``skip_zero_advantage``).

        Such a row adds exactly nothing to the gradient of the PPO / decoupled loss (every
        token's term is ``-A * f(ratio)`` with ``A = 0``) as long as the loss has no other
        per-token term; the caller's ``LossNorm`` was computed on all of ``mini``, so the
        remaining rows keep their weights and the update is the same.
        """
        a = self.algo
        loss_kl = a.kl_placement == "loss" and a.kl_coef > 0
        loss_distill = a.distill.teacher_path is not None and a.distill.mode == "loss"
        if not a.skip_zero_advantage or loss_kl or loss_distill or a.entropy_coef != 0:
            return mini
        assert mini.advantages is not None
        keep = ((mini.advantages * mini.response_mask) != 0).any(dim=1)
        if bool(keep.all()):
            return mini
        return mini.select(keep.nonzero().squeeze(1))

    @property
    def single_update(self) -> bool:
        """One optimizer step per training step (epochs = mini_batches = 1)."""
        return self.algo.epochs == 1 and self.algo.mini_batches == 1

    def _mini_batches(self, exp: Experience) -> list[Experience]:
        """This epoch's mini-batches (a data-parallel rank: its part of the global ones)."""
        return self.parallelism.mini_batches(exp, self.algo.mini_batches, self.generator)

    def _loss_norm(self, mini: Experience) -> LossNorm:
        """The step-global normaliser (data parallel: the counts summed over ranks)."""
        a = self.algo
        empty = a.seq_mean_empty_rows == "count"
        mask = mini.response_mask
        return self.parallelism.loss_norm(mask, a.loss_agg, self.max_response_tokens, empty)

    def _clip_and_step(self) -> Tensor:
        """Reduce, clip, step; the gradient norm before clipping (a device tensor)."""
        return clip_and_step(
            self.parallelism, self.model, self.optimizer, self.scheduler, self.grad_clip
        )

    def state_dict(self) -> dict[str, Tensor]:
        """The rollout engine's full weights (LoRA: merged, under the base model's keys);
        sharded: full tensors on rank 0, ``{}`` elsewhere (every rank must call)."""
        return self.parallelism.full_state_dict(self.model, merged=True)

    def adapter_state(self) -> dict[str, Tensor]:
        """The model's own full state dict (LoRA: the peft model's, adapters included: what
        ``save_adapter`` writes); sharded: on rank 0, ``{}`` elsewhere (a collective)."""
        return self.parallelism.full_state_dict(self.model, merged=False)
