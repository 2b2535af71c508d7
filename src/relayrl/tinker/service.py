"""The state behind the Tinker API: served base models, training models, samplers.

Every method here runs in the service's single worker thread (:mod:`relayrl.tinker.worker`),
one request at a time in arrival order, so a model is never trained and read at once and the
engine (single-threaded) has one caller. A user error (unknown model, a datum longer than the
context, a bad checkpoint path, ...) raises :class:`UserError`: the SDK's failed request.

Training models. ``create_model`` with a LoRA rank > 0 wraps a private copy of the base model
in ``peft`` adapters (relayrl's :func:`relayrl.model.lora.apply_lora`, alpha = 32, on the
attention / MLP / unembedding linears the request selects); rank 0 trains every parameter.
Each training model has its own AdamW; ``forward_backward`` accumulates gradients until
``optim_step`` applies the step's ``AdamParams``. Several training models may share one base.

Sampling. One relayrl :class:`~relayrl.rollout.engine.RolloutEngine` per base model serves
every sampler of that base: before a batch of requests for another set of weights, the
engine gets them (``update_weights``, a new engine version). A sampler's weights are the
merged state dict captured by ``save_weights_for_sampler`` (or loaded from its checkpoint
directory after a restart, or the base weights).
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from relayrl.config import LoraConfig
from relayrl.model.loading import (
    disable_dropout,
    load_causal_lm,
    load_tokenizer,
    model_context_length,
)
from relayrl.model.lora import apply_lora, merged_state_dict, save_merged
from relayrl.rollout.engine import RolloutEngine
from relayrl.tinker.adam import check_adam_params
from relayrl.tinker.checkpoints import (
    CheckpointError,
    CheckpointPath,
    CheckpointStore,
    check_name,
)
from relayrl.tinker.losses import LossInputError, check_loss, datum_loss
from relayrl.tinker.sampling import SampleJob, run_sample_jobs
from relayrl.tinker.wire import (
    WireDatum,
    WireError,
    WireForwardBackward,
    encode_forward_backward_output,
)

LORA_ALPHA = 32.0
LORA_GROUPS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "c_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj", "c_fc"),
    "train_unembed": ("lm_head",),
}


class UserError(ValueError):
    """The request is wrong (the SDK's ``RequestFailedError`` with category ``user``)."""


@dataclass
class ServedBase:
    """A local model directory the service was started with."""

    name: str
    path: Path
    tokenizer: Any
    context_length: int
    arch: str
    weights: PreTrainedModel
    engine: RolloutEngine | None = None
    engine_key: str = "base"


@dataclass
class TrainingModel:
    model_id: str
    base: ServedBase
    module: Any  # a peft model (LoRA) or the PreTrainedModel itself (rank 0)
    rank: int
    targets: list[str]
    optimizer: torch.optim.AdamW
    accumulated: int = 0
    steps: int = 0
    user_metadata: dict[str, str] | None = None


@dataclass
class Sampler:
    sampler_id: str
    base: ServedBase
    key: str
    model_path: str | None
    state: dict[str, torch.Tensor] | None = None
    clients: int = 0
    expired: bool = False


class TinkerService:
    """Models, optimizers, samplers and checkpoints of one ``relayrl tinker-serve``."""

    def __init__(
        self,
        model_dirs: list[str | Path],
        state_dir: str | Path,
        seed: int = 0,
        max_slots: int = 32,
        keep_samplers: int = 4,
    ) -> None:
        """``keep_samplers``: weights of unnamed samplers (``save_weights_and_get_sampling_client``)
        kept in memory; an older one is dropped and sampling from it is a user error (a named
        ``save_weights_for_sampler`` checkpoint reloads from disk instead)."""
        self.keep_samplers = keep_samplers
        if not model_dirs:
            raise ValueError("tinker-serve needs at least one model directory")
        self.seed = seed
        self.max_slots = max_slots
        self.store = CheckpointStore(state_dir)
        self.bases: dict[str, ServedBase] = {}
        for d in model_dirs:
            base = self._load_base(Path(d))
            self.bases[base.name] = base
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._sampler_states: dict[str, dict[str, torch.Tensor]] = {}
        self._in_memory: list[str] = []  # unnamed samplers holding weights, oldest first

    # ------------------------------------------------------------------ bases
    @staticmethod
    def _load_base(path: Path) -> ServedBase:
        tokenizer = load_tokenizer(path)
        model = load_causal_lm(path)
        disable_dropout(model).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        ctx = model_context_length(path)
        context = ctx[0] if ctx else 2048
        arch = type(model).__name__
        return ServedBase(str(path.resolve()), path.resolve(), tokenizer, context, arch, model)

    def base(self, name: str) -> ServedBase:
        """A served base by the name it is listed under, its directory, or the directory's
        base name; anything else is a user error that lists the served ones."""
        if name in self.bases:
            return self.bases[name]
        for b in self.bases.values():
            if name in (str(b.path), b.path.name) or Path(name).resolve() == b.path:
                return b
        raise UserError(
            f"unknown base model {name!r}; this service serves: {', '.join(self.bases)}"
        )

    def capabilities(self) -> dict[str, Any]:
        return {
            "supported_models": [
                {
                    "model_name": b.name,
                    "max_context_length": b.context_length,
                    "trainable": True,
                    "sampleable": True,
                }
                for b in self.bases.values()
            ]
        }

    # ------------------------------------------------------------------ training models
    def model(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise UserError(f"unknown model_id {model_id!r} (never created, or unloaded)")
        return self.models[model_id]

    def create_model(
        self,
        model_id: str,
        base_model: str,
        lora: dict[str, Any] | None,
        targets: list[str] | None = None,
        user_metadata: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A training model; ``targets`` (create-via-load) overrides the LoRA layer choice."""
        if model_id in self.models:
            raise UserError(f"model_id {model_id!r} exists already")
        base = self.base(base_model)
        lora = lora or {"rank": 0}
        rank = int(lora.get("rank", 0))
        if rank < 0:
            raise UserError(f"lora rank must be >= 0, got {rank}")
        seed = lora.get("seed")
        torch.manual_seed(self.seed + len(self.models) if seed is None else int(seed))
        module = copy.deepcopy(base.weights)
        chosen: list[str] = list(targets or [])
        if rank > 0 and not chosen:
            names = {
                n.rsplit(".", 1)[-1]
                for n, m in module.named_modules()
                if isinstance(m, torch.nn.Linear)
            }
            tied = bool(getattr(module.config, "tie_word_embeddings", False))
            for flag, group in LORA_GROUPS.items():
                if lora.get(flag, True) and not (flag == "train_unembed" and tied):
                    chosen += [t for t in group if t in names]
            if not chosen:
                raise UserError(f"no linear layer of {base.arch} matches the LoRA selection")
        chosen = sorted(set(chosen))
        if rank > 0:
            cfg = LoraConfig(r=rank, alpha=LORA_ALPHA, target_modules=chosen)
            module = apply_lora(module, cfg)
        else:
            for p in module.parameters():
                p.requires_grad_(True)
        module.eval()
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.models[model_id] = TrainingModel(
            model_id, base, module, rank, chosen, opt, user_metadata=user_metadata
        )
        return {"model_id": model_id, "type": "create_model"}

    def unload_model(self, model_id: str) -> dict[str, Any]:
        self.model(model_id)
        del self.models[model_id]
        return {"model_id": model_id, "type": "unload_model"}

    def get_info(self, model_id: str) -> dict[str, Any]:
        tm = self.model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": tm.base.arch,
                "model_name": tm.base.name,
                "tokenizer_id": str(tm.base.path),
            },
            "is_lora": tm.rank > 0,
            "lora_rank": tm.rank if tm.rank > 0 else None,
            "model_name": tm.base.name,
        }

    def _target_logprobs(self, tm: TrainingModel, data: list[WireDatum]) -> list[torch.Tensor]:
        """log p(target_tokens[i] | tokens[:i+1]) per datum, fp32, with the graph; shape [N],
        or [N, K] for [N, K] target_tokens (K candidate tokens per position, top-K
        distillation: log p(target_tokens[i, k] | tokens[:i+1]))."""
        vocab = int(tm.base.weights.get_output_embeddings().weight.shape[0])
        for i, d in enumerate(data):
            if not d.tokens:
                raise UserError(f"datum {i} has an empty model_input")
            if len(d.tokens) > tm.base.context_length:
                raise UserError(
                    f"datum {i} has {len(d.tokens)} tokens, longer than the model's context "
                    f"of {tm.base.context_length}"
                )
            tgt = d.inputs.get("target_tokens")
            if tgt is None:
                raise UserError(f"datum {i} has no loss_fn_inputs['target_tokens']")
            if tgt.dim() not in (1, 2) or tgt.shape[0] != len(d.tokens) or tgt.numel() == 0:
                raise UserError(
                    f"datum {i}: target_tokens has shape {list(tgt.shape)}, the model input "
                    f"has {len(d.tokens)} tokens"
                )
            if int(tgt.min()) < 0 or int(tgt.max()) >= vocab or max(d.tokens) >= vocab:
                raise UserError(f"datum {i}: a token id is outside the vocabulary (0..{vocab - 1})")
        width = max(len(d.tokens) for d in data)
        pad = int(tm.base.tokenizer.pad_token_id or 0)
        ids = torch.full((len(data), width), pad, dtype=torch.long)
        mask = torch.zeros((len(data), width), dtype=torch.long)
        for i, d in enumerate(data):
            ids[i, : len(d.tokens)] = torch.tensor(d.tokens)
            mask[i, : len(d.tokens)] = 1
        logits = tm.module(input_ids=ids, attention_mask=mask).logits.float()
        logp = torch.log_softmax(logits, dim=-1)
        out = []
        for i, d in enumerate(data):
            tgt = d.inputs["target_tokens"].long()
            picked = logp[i, : len(d.tokens)].gather(-1, tgt.reshape(len(d.tokens), -1))
            out.append(picked.reshape(tgt.shape))
        return out

    def forward_backward(self, fb: WireForwardBackward) -> bytes:
        tm = self.model(fb.model_id)
        if not fb.data:
            raise UserError("forward_backward got no data")
        try:
            config = check_loss(fb.loss_fn, fb.config)
            with torch.set_grad_enabled(not fb.forward_only):
                lps = self._target_logprobs(tm, fb.data)
                losses = [
                    datum_loss(fb.loss_fn, lp, d.inputs, config)
                    for lp, d in zip(lps, fb.data, strict=True)
                ]
                total = torch.stack(losses).sum()
                if not fb.forward_only:
                    total.backward()
                    tm.accumulated += 1
        except (LossInputError, WireError) as e:
            raise UserError(str(e)) from e
        outputs: list[dict[str, np.ndarray]] = []
        for lp, d in zip(lps, fb.data, strict=True):
            row = {"logprobs": lp.detach().numpy()}
            if fb.loss_fn == "cross_entropy":
                w = d.inputs.get("weights")
                w_np = w.float().numpy() if w is not None else np.ones_like(row["logprobs"])
                row["elementwise_loss"] = -(w_np * row["logprobs"])
            outputs.append(row)
        return encode_forward_backward_output(outputs, {"loss:sum": float(total.detach())})

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, Any]:
        tm = self.model(model_id)
        if adam.get("type", "adamw") not in ("adamw", "adam"):
            raise UserError(f"optimizer {adam.get('type')!r} is not supported (AdamParams only)")
        try:
            hp = check_adam_params(adam)
        except ValueError as e:
            raise UserError(str(e)) from e
        lr = hp["learning_rate"]
        for g in tm.optimizer.param_groups:
            g["lr"] = lr
            g["betas"] = (hp["beta1"], hp["beta2"])
            g["eps"] = hp["eps"]
            g["weight_decay"] = hp["weight_decay"]
        params = [p for g in tm.optimizer.param_groups for p in g["params"]]
        clip = hp["grad_clip_norm"]
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            if grads
            else 0.0
        )
        if not np.isfinite(norm):  # a step would make every weight NaN
            tm.optimizer.zero_grad(set_to_none=True)
            tm.accumulated = 0
            raise UserError(
                f"the accumulated gradients are not finite (grad_norm {norm}); the step was "
                "skipped and the gradients cleared, the weights are unchanged"
            )
        if clip > 0 and grads:
            torch.nn.utils.clip_grad_norm_(params, clip)
        tm.optimizer.step()
        tm.optimizer.zero_grad(set_to_none=True)
        calls, tm.accumulated = tm.accumulated, 0
        tm.steps += 1
        return {
            "metrics": {"grad_norm": norm, "accumulated_calls": float(calls), "learning_rate": lr}
        }

    # ------------------------------------------------------------------ checkpoints
    def _meta(self, tm: TrainingModel) -> dict[str, Any]:
        return {
            "base_model": tm.base.name,
            "rank": tm.rank,
            "targets": tm.targets,
            "alpha": LORA_ALPHA,
            "steps": tm.steps,
            "user_metadata": tm.user_metadata,
        }

    def save_state(
        self, model_id: str, name: str | None, overwrite: bool = False, user_metadata: Any = None
    ) -> dict[str, Any]:
        tm = self.model(model_id)
        path = CheckpointPath(model_id, "weights", check_name(name or f"step-{tm.steps:06d}"))
        if not overwrite:  # as Tinker: a name saved already is refused
            self.store.check_free(path, "save_state(name, overwrite=True)")

        def fill(d: Path) -> None:
            trainable = {
                n: p.detach().contiguous().clone()
                for n, p in tm.module.named_parameters()
                if p.requires_grad
            }
            save_file(trainable, str(d / "trainable.safetensors"))
            torch.save(tm.optimizer.state_dict(), d / "optimizer.pt")

        self.store.write(path, fill, self._meta(tm), user_metadata)
        return {"path": path.uri, "type": "save_weights"}

    def load_state(
        self,
        model_id: str,
        uri: str,
        optimizer: bool,
        create: bool = False,
        base_model: str | None = None,
    ) -> dict[str, Any]:
        """``load_state`` into ``model_id``; ``create`` (create_training_client_from_state)
        first creates it like the checkpoint's model (its base unless ``base_model``)."""
        try:
            path = CheckpointPath.parse(uri)
            if path.kind != "weights":
                raise CheckpointError(f"{uri} is a sampler checkpoint; load_state needs weights/")
            d, meta = self.store.read(path)
        except CheckpointError as e:
            raise UserError(str(e)) from e
        if create:
            self.create_model(
                model_id,
                base_model or meta["base_model"],
                {"rank": meta["rank"]},
                targets=meta["targets"],
                user_metadata=meta.get("user_metadata"),
            )
        tm = self.model(model_id)
        if (
            meta["base_model"] != tm.base.name
            or meta["rank"] != tm.rank
            or sorted(meta["targets"]) != tm.targets
        ):
            raise UserError(
                f"{uri} was saved from base {meta['base_model']} with LoRA rank {meta['rank']}; "
                f"model {model_id} is base {tm.base.name} with rank {tm.rank}"
            )
        state = load_file(str(d / "trainable.safetensors"))
        own = {n: p for n, p in tm.module.named_parameters() if p.requires_grad}
        if set(state) != set(own):
            raise UserError(f"{uri} holds other parameters than model {model_id}")
        with torch.no_grad():
            for n, p in own.items():
                p.copy_(state[n])
        tm.optimizer.zero_grad(set_to_none=True)
        tm.accumulated = 0
        if optimizer:
            tm.optimizer.load_state_dict(torch.load(d / "optimizer.pt", weights_only=True))
        tm.steps = int(meta.get("steps", 0))
        return {"path": uri, "model_id": model_id, "type": "load_weights"}

    def _merged(self, tm: TrainingModel) -> dict[str, torch.Tensor]:
        if tm.rank > 0:
            return {k: v.clone() for k, v in merged_state_dict(tm.module).items()}
        return {k: v.detach().clone() for k, v in tm.module.state_dict().items()}

    def save_for_sampler(
        self, model_id: str, name: str | None, user_metadata: Any = None
    ) -> dict[str, Any]:
        """Named: a sampler checkpoint (HF directory) whose path a sampling client can open;
        saving under a name again replaces it: every sampler on the path serves the new weights
        to the requests sent after the save (a worker barrier), the old to those before. Unnamed
        (``save_weights_and_get_sampling_client``): a sampler on these weights."""
        tm = self.model(model_id)
        state = self._merged(tm)
        if name is None:
            sid = self.new_sampler(tm.base, f"mem-{uuid.uuid4().hex}", None, state)
            return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}
        path = CheckpointPath(model_id, "sampler_weights", check_name(name))

        def fill(d: Path) -> None:
            if tm.rank > 0:
                save_merged(tm.module, tm.base.tokenizer, d)
            else:
                tm.module.save_pretrained(str(d))
                tm.base.tokenizer.save_pretrained(str(d))

        self.store.write(path, fill, self._meta(tm), user_metadata)
        self._cache_state(path.uri, state)
        if tm.base.engine_key == path.uri:  # the engine holds what this save replaced
            tm.base.engine_key = ""
        return {"path": path.uri, "type": "save_weights_for_sampler"}

    # ------------------------------------------------------------------ samplers
    def new_sampler(
        self,
        base: ServedBase,
        key: str,
        model_path: str | None,
        state: dict[str, torch.Tensor] | None,
    ) -> str:
        sid = f"sampler-{uuid.uuid4().hex[:16]}"
        self.samplers[sid] = Sampler(sid, base, key, model_path, state)
        if model_path is None and state is not None:
            self._in_memory.append(sid)
            while len(self._in_memory) > self.keep_samplers:
                old = self.samplers[self._in_memory.pop(0)]
                old.state, old.expired = None, True
        return sid

    def _cache_state(self, uri: str, state: dict[str, torch.Tensor]) -> None:
        """Keep a named sampler's weights in memory (the newest ``keep_samplers``; an evicted
        one reloads from its checkpoint directory)."""
        self._sampler_states.pop(uri, None)
        self._sampler_states[uri] = state
        while len(self._sampler_states) > self.keep_samplers:
            del self._sampler_states[next(iter(self._sampler_states))]

    def forget_sampler_weights(self, uri: str) -> None:
        """Drop the in-memory weights of a (deleted) sampler checkpoint."""
        self._sampler_states.pop(uri, None)

    def create_sampling_session(self, base_model: str | None, model_path: str | None) -> str:
        if model_path:
            try:
                path = CheckpointPath.parse(model_path)
                if path.kind != "sampler_weights":
                    raise CheckpointError(
                        f"{model_path}: sample from a sampler_weights/ checkpoint "
                        "(save_weights_for_sampler)"
                    )
                _, meta = self.store.read(path)
            except CheckpointError as e:
                raise UserError(str(e)) from e
            return self.new_sampler(self.base(meta["base_model"]), model_path, model_path, None)
        if not base_model:
            raise UserError("a sampling client needs a base_model or a model_path")
        return self.new_sampler(self.base(base_model), "base", None, None)

    def sampler(self, sampler_id: str) -> Sampler:
        if sampler_id not in self.samplers:
            raise UserError(f"unknown sampling session {sampler_id!r}")
        s = self.samplers[sampler_id]
        if s.expired:
            raise UserError(
                f"sampling session {sampler_id} expired: its weights were dropped after "
                f"{self.keep_samplers} newer unnamed samplers (use save_weights_for_sampler(name) "
                "to keep them)"
            )
        return s

    def _engine_for(self, s: Sampler) -> RolloutEngine:
        """The base's engine holding ``s``'s weights (swapped in when another sampler's were)."""
        base = s.base
        if base.engine is None:
            tok = base.tokenizer
            base.engine = RolloutEngine(
                copy.deepcopy(base.weights),
                eos_token_id=int(tok.eos_token_id),
                pad_token_id=int(tok.pad_token_id),
                max_slots=self.max_slots,
                max_model_len=base.context_length,
                seed=self.seed,
            )
            base.engine_key = "base"
        if base.engine_key != s.key:
            if s.key == "base":
                state = dict(base.weights.state_dict())
            elif s.state is not None:
                state = s.state
            elif s.key in self._sampler_states:
                state = self._sampler_states[s.key]
            else:
                try:
                    d, _ = self.store.read(CheckpointPath.parse(s.key))
                except CheckpointError as e:
                    raise UserError(f"sampling session {s.sampler_id}: {e}") from e
                state = dict(load_causal_lm(d).state_dict())
                self._cache_state(s.key, state)
            base.engine.update_weights(state, base.engine.version + 1, interrupt=True)
            base.engine_key = s.key
        return base.engine

    def sample(self, jobs: list[SampleJob]) -> list[bytes | Exception]:
        """Run sample requests; those for the same sampler share one engine batch."""
        results: dict[int, bytes | Exception] = {}
        by_sampler: dict[str, list[int]] = {}
        for i, job in enumerate(jobs):
            by_sampler.setdefault(job.sampler_id, []).append(i)
        for sid, idx in by_sampler.items():
            try:
                s = self.sampler(sid)
                engine = self._engine_for(s)
            except Exception as e:  # noqa: BLE001 - handed back per request
                for i in idx:
                    results[i] = e
                continue
            outs = run_sample_jobs(engine, s.base.tokenizer, [jobs[i] for i in idx], UserError)
            for i, out in zip(idx, outs, strict=True):
                results[i] = out
        return [results[i] for i in range(len(jobs))]
