"""relayrl's built-in generation engine: continuous batching on any Hugging Face causal LM.

``RolloutEngine`` ties together the scheduler (admission + slot table, ``scheduler.py``), the
per-slot KV cache (``kv_cache.py``), the model runner (one batched prefill+decode forward per
step, ``model_runner.py``) and the sampler (per-request seeds, ``sampler.py``). Each step admits
waiting requests into the slots freed by the previous step, runs every live sequence one token
forward, samples, and returns what finished.
Each finished :class:`Sample` carries per response token: the sampled id, its behaviour
logprob under the exact distribution it was drawn from (see :mod:`relayrl.rollout.sampler`),
and the policy version of the weights that produced it, stamped here by the engine; on request
(``SamplingParams.top_logprobs``) the top alternatives too (:mod:`relayrl.rollout.top_logprobs`).

Errors. ``submit`` validates a request and raises :class:`InvalidRequestError` (a
``ValueError``) with a message naming the problem; nothing is enqueued, so other requests are
not disturbed. ``generate`` (the list convenience) instead returns, in that request's place,
a ``Sample`` with ``finish_reason='abort'`` and ``error`` set, and completes the others.

The engine is single-threaded: call ``submit`` / ``step`` / ``update_weights`` from one thread.

Device. The engine computes where its model is (``next(model.parameters()).device``, or an
explicit ``device=`` that must agree): the KV arenas, each step's ids / positions / masks /
write indices and the sampler's tensors are made there, the slot table, lengths and tokens
stay Python lists. A step moves its inputs host -> device without a stream sync and brings
back one ``[2, rows]`` tensor (sampled tokens and logprobs): one device -> host sync per
forward (``relayrl.rollout.transfer``). On CUDA the step's timings (``prefill_time_s``,
``decode_time_s``) then measure the launch, and ``sample_time_s`` includes the wait for the
forward's kernels.
"""

from __future__ import annotations

import copy
import itertools
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
from torch import Tensor
from transformers import PreTrainedModel

from relayrl.rollout import top_logprobs
from relayrl.rollout.cuda_graphs import DecodeGraphs
from relayrl.rollout.kv_cache import SlotKVCache
from relayrl.rollout.model_runner import ModelRunner
from relayrl.rollout.sampler import SamplingSettings, sample
from relayrl.rollout.scheduler import ScheduledGroup, Scheduler, Sequence
from relayrl.rollout.transfer import model_device
from relayrl.rollout.types import (
    EngineReport,
    FinishReason,
    GenerationRequest,
    Sample,
    error_sample,
)


class InvalidRequestError(ValueError):
    """A request the engine cannot run (empty prompt, too long, bad ids or params)."""


class RolloutEngine:
    """Continuous-batching generation with per-token behaviour logprobs and versions.

    Args:
        model: a Hugging Face causal LM (``AutoModelForCausalLM``); put in eval mode. The engine
            keeps a reference and loads new weights into it in ``update_weights``; give it its
            own copy if a trainer mutates the same module.
        eos_token_id: ends a request (finish ``'eos'``, the EOS token is part of the response).
        pad_token_id: filler for padded positions (never attended to).
        max_slots: how many sequences decode concurrently (KV slots).
        max_model_len: context length (prompt + response); default the model's
            ``max_position_embeddings``.
        version: policy version of the initial weights.
        seed: seeds the per-request seeds of requests that do not give one.
        device: where the engine computes; default (None) the model's device. Given, it must
            be the model's (``ValueError`` otherwise): the engine never moves the model.
        cuda_graphs: decode-only steps replayed as CUDA graphs (``relayrl.rollout.cuda_graphs``;
            Llama / Qwen2 / Mistral models, prefills stay eager). Default (None): on when the
            model is on a CUDA device, off on the CPU; True on the CPU is a ``ValueError``.
    """

    supports_top_logprobs = True  # ``SamplingParams.top_logprobs`` (``rollout.top_logprobs``)

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_id: int,
        pad_token_id: int,
        max_slots: int = 32,
        max_model_len: int | None = None,
        version: int = 0,
        seed: int = 0,
        urgent_steps: int = 4,
        device: torch.device | str | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        config = getattr(model, "config", None)
        if max_model_len is None:
            max_model_len = getattr(config, "max_position_embeddings", None)
            if max_model_len is None:
                raise ValueError(
                    "the model config has no max_position_embeddings; pass max_model_len"
                )
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        if max_slots <= 0:
            raise ValueError(f"max_slots must be > 0, got {max_slots}")
        if urgent_steps < 0:
            raise ValueError(f"urgent_steps must be >= 0, got {urgent_steps}")
        _check_supported(config)
        self.device = model_device(model, device)
        # a HF causal LM (the runner calls its forward / config / heads); callers hold it as a
        # Module (a PEFT-merged or FSDP-gathered copy): typed once here, no per-step cost
        self.model = cast(PreTrainedModel, model.eval())
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.max_slots = max_slots
        self.max_model_len = int(max_model_len)
        self.version = version
        self.input_vocab = _input_vocab_size(model, config)
        self.output_vocab = _output_vocab_size(model, config)
        self.kv_cache = SlotKVCache(max_slots, self.max_model_len, device=self.device)
        self.scheduler = Scheduler(self.kv_cache)
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        graphs = None
        if cuda_graphs:  # (on the CPU: a ValueError)
            graphs = DecodeGraphs(self.model, pad_token_id, max_slots, self.device, capture=True)
        self.runner = ModelRunner(pad_token_id, max_slots, device=self.device, graphs=graphs)
        self._models: dict[int, PreTrainedModel] = {version: self.model}
        self._ids = itertools.count()
        self._seed_rng = random.Random(seed)
        self._finished: list[Sample] = []  # finished outside step() (aborts), or not yet handed out
        self.urgent_steps = urgent_steps
        self._urgent_groups: frozenset[int] = frozenset()
        self._urgent_left = 0  # urgent-only steps left before the next full step
        self._stats: dict[str, float] = {
            "steps": 0,
            "forwards": 0,
            "tokens_generated": 0,
            "prefill_tokens": 0,
            "requests_submitted": 0,
            "requests_finished": 0,
            "requests_aborted": 0,
            "sequences_interrupted": 0,
            "weight_updates": 0,
            "slot_steps": 0,
            "urgent_steps": 0,
            "prefill_time_s": 0.0,
            "decode_time_s": 0.0,
            "sample_time_s": 0.0,
        }

    # ------------------------------------------------------------------ requests
    def submit(self, request: GenerationRequest) -> int:
        """Queue a request; returns its id. Raises InvalidRequestError on bad input."""
        seq = self._make_sequence(next(self._ids), request)
        self.scheduler.add(seq)
        self._stats["requests_submitted"] += 1
        return seq.request_id

    def _make_sequence(self, request_id: int, request: GenerationRequest) -> Sequence:
        prompt = list(request.prompt_ids)
        p = request.params
        if not prompt:
            raise InvalidRequestError(
                "prompt_ids is empty: a request needs at least one prompt token"
            )
        bad = [t for t in prompt if not 0 <= t < self.input_vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.input_vocab})"
            )
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}: "
                "no room to generate a token"
            )
        bad = [t for t in p.stop_token_ids if not 0 <= t < self.output_vocab]
        if bad:
            raise InvalidRequestError(
                f"stop token id {bad[0]} is outside the vocabulary [0, {self.output_vocab})"
            )
        if p.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be > 0, got {p.max_tokens}")
        if p.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {p.temperature}")
        if not 0.0 < p.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p.top_p}")
        if p.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 = off), got {p.top_k}")
        if (why := top_logprobs.check(p.top_logprobs)) is not None:
            raise InvalidRequestError(why)
        greedy = p.greedy or p.temperature == 0
        seed = p.seed if p.seed is not None else self._seed_rng.getrandbits(63)
        settings = SamplingSettings(
            greedy=greedy,
            temperature=1.0 if greedy else float(p.temperature),
            top_k=0 if greedy else int(p.top_k),
            top_p=1.0 if greedy else float(p.top_p),
            seed=int(seed),
        )
        return Sequence(
            request_id=request_id,
            request=request,
            tokens=prompt,
            prompt_len=len(prompt),
            settings=settings,
            max_tokens=min(p.max_tokens, self.max_model_len - len(prompt)),
            stop_ids=frozenset(p.stop_token_ids),
            stop_on_eos=not p.ignore_eos,
            top=[] if p.top_logprobs else None,  # alternatives kept (``top_logprobs``)
        )

    def abort(self, request_id: int) -> bool:
        """Stop a waiting or running request. Its sample (finish ``'abort'``, tokens so far)
        comes out of the next ``step``/``drain``. Returns False if the id is not live."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return False
        self._finished.append(self._to_sample(seq, "abort"))
        self._stats["requests_aborted"] += 1
        self._release_old_models()
        return True

    def progress(self, request_id: int, start: int = 0) -> tuple[Any, ...] | None:
        """A running request's response tokens from index ``start`` on, as (ids, behaviour
        logprobs, versions), and their alternatives when it asked for ``top_logprobs``; None
        when it is not running (waiting, finished or unknown).
        Read by a streaming caller between steps; costs nothing when nobody asks."""
        seq = self.scheduler.running.get(request_id)
        if seq is None:
            return None
        a = seq.prompt_len + start
        out = seq.tokens[a:], seq.logprobs[start:], seq.versions[start:]
        return out if seq.top is None else (*out, seq.top[start:])

    # ------------------------------------------------------------------ running
    def has_unfinished(self) -> bool:
        """True while some submitted request has not been returned yet."""
        return self.scheduler.has_work() or bool(self._finished)

    def step(self) -> list[Sample]:
        """One scheduler step (admissions + one forward per weights version). Returns the
        samples finished in it (and any aborted since the last call)."""
        out, self._finished = self._finished, []
        if not self.scheduler.has_work():
            return out
        with torch.inference_mode():
            groups = self.scheduler.schedule(self.version)
            urgent = self._urgent_only(groups)
            for group in urgent or groups:
                out.extend(self._run_group(group.weights_version, group.seqs))
        self._stats["steps"] += 1
        self._stats["urgent_steps"] += bool(urgent)
        if out:
            self._release_old_models()
        return out

    def prioritize(self, group_ids: Iterable[int]) -> None:
        """Make the requests of these groups urgent (a trainer waits for them); empty ends it.

        While an urgent request is running next to others, every full step is followed by
        ``urgent_steps`` steps that decode only the urgent rows. A forward here costs about
        ``overhead + rows x per_row``, so a few stragglers step several times faster alone than
        inside a full batch, and the rest of the batch still advances every
        ``urgent_steps + 1`` steps.
        """
        self._urgent_groups = frozenset(group_ids)
        if not self._urgent_groups:
            self._urgent_left = 0

    def _urgent_only(self, groups: list[ScheduledGroup]) -> list[ScheduledGroup]:
        """This step's forwards restricted to the urgent rows, or [] for a full step."""
        if not self._urgent_groups or not self.urgent_steps:
            return []
        if self._urgent_left == 0:  # a full step now, then the urgent-only ones
            self._urgent_left = self.urgent_steps
            return []
        self._urgent_left -= 1
        urgent = [
            ScheduledGroup(g.weights_version, seqs)
            for g in groups
            if (seqs := [s for s in g.seqs if s.request.group_id in self._urgent_groups])
        ]
        n_urgent = sum(len(g.seqs) for g in urgent)
        if n_urgent == 0 or n_urgent == sum(len(g.seqs) for g in groups):
            return []  # nothing urgent is running, or the step is urgent as a whole
        return urgent

    def _run_group(self, weights_version: int, seqs: list[Sequence]) -> list[Sample]:
        t0 = time.perf_counter()
        starts = [s.num_computed for s in seqs]
        new_tokens = [s.tokens[s.num_computed :] for s in seqs]
        # Prefill rows: fresh or interrupted sequences (nothing of them in the cache yet).
        num_prefill = sum(len(t) for t, s in zip(new_tokens, starts, strict=True) if s == 0)
        logits = self.runner.execute(
            self._models[weights_version],
            self.kv_cache,
            [s.slot for s in seqs],
            starts,
            new_tokens,
        )
        t1 = time.perf_counter()
        tokens, logprobs = sample(
            logits, [s.settings for s in seqs], [s.num_generated for s in seqs]
        )
        if self.scheduler.with_top:  # off: one int test (``rollout.top_logprobs``)
            top_logprobs.capture(logits, seqs)
        t2 = time.perf_counter()
        finished = []
        for seq, tok, lp in zip(seqs, tokens, logprobs, strict=True):
            seq.num_computed = len(seq.tokens)
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(weights_version)
            reason = self._finish_reason(seq, tok)
            if reason is not None:
                self.scheduler.finish(seq)
                finished.append(self._to_sample(seq, reason))
        st = self._stats
        st["tokens_generated"] += len(seqs)
        st["prefill_tokens"] += num_prefill
        st["slot_steps"] += len(seqs)
        st["prefill_time_s" if num_prefill else "decode_time_s"] += t1 - t0
        st["sample_time_s"] += t2 - t1
        st["requests_finished"] += len(finished)
        return finished

    def _finish_reason(self, seq: Sequence, tok: int) -> FinishReason | None:
        if tok == self.eos_token_id and seq.stop_on_eos:
            return "eos"
        if tok in seq.stop_ids:
            return "stop"
        if seq.num_generated >= seq.max_tokens:
            return "length"
        return None

    def drain(self) -> list[Sample]:
        """Run until every submitted request is finished; return all finished samples."""
        out: list[Sample] = []
        while self.has_unfinished():
            out.extend(self.step())
        return out

    def iter_finished(self) -> Iterator[Sample]:
        """Yield samples as they finish until nothing is left (requests may be submitted
        while iterating)."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        """Run ``requests`` to completion and return their samples in request order.

        A bad request yields a ``Sample`` with ``finish_reason='abort'`` and ``error`` set in
        its place. Samples of other requests that finish meanwhile are kept for the next
        ``step``/``drain``.
        """
        results: dict[int, Sample] = {}
        order: list[int] = []
        for req in requests:
            rid = next(self._ids)
            try:
                seq = self._make_sequence(rid, req)
            except InvalidRequestError as e:
                results[rid] = error_sample(rid, req, str(e))
            else:
                self.scheduler.add(seq)
                self._stats["requests_submitted"] += 1
            order.append(rid)
        return run_until_done(self.step, order, results, self._finished)

    # ------------------------------------------------------------------ weights
    def update_weights(
        self,
        state_dict: Mapping[str, Tensor],
        version: int,
        interrupt: bool = True,
        strict: bool = True,
    ) -> None:
        """Load new weights and make them version ``version``.

        ``interrupt=True``: every in-flight sequence drops its KV and re-prefills prompt +
        tokens so far under the new weights at the next step; its later tokens carry the new
        version. ``interrupt=False``: in-flight sequences finish under the weights they
        started with (a copy of the old module is kept until they are done); requests admitted
        from now on use the new weights.
        """
        self._check_version(version)
        state = dict(state_dict)
        self._check_state_dict(state, strict)  # before touching anything: no half-loaded model
        interrupt = self._keep_old_model(interrupt)
        with torch.no_grad():
            self.model.load_state_dict(state, strict=strict)
        self._commit_version(version, interrupt)

    def update_weights_streamed(
        self,
        parts: Iterable[Mapping[str, Tensor]],
        version: int,
        shapes: Mapping[str, tuple[int, ...]],
        interrupt: bool = True,
    ) -> None:
        """``update_weights`` from a stream of partial state dicts, each copied into the model
        as it arrives (the caller never holds more than one part: bounded memory).

        ``shapes`` names every key the stream will carry, with its shape: it must be exactly
        the model's keys and shapes, checked before anything loads. Every key must then
        arrive once; ``version`` becomes current after the last part. The caller holds the
        engine (no ``step`` runs on the half-loaded model). A stream that fails part-way (a
        sender died) leaves the model half-loaded at the old version: the caller must not
        step it until an update completes; in-flight sequences keep the copy of the old
        weights kept for them (``interrupt=False``), or re-prefill under the next weights.
        """
        self._check_version(version)
        current = self.model.state_dict()
        self._check_state_dict(
            {k: torch.empty(tuple(v), device="meta") for k, v in shapes.items()}, True
        )
        interrupt = self._keep_old_model(interrupt)
        seen: set[str] = set()
        for part in parts:
            unknown = sorted(k for k in part if k not in shapes or k in seen)
            if unknown:
                raise ValueError(f"weight stream: unannounced or repeated keys {unknown[:5]}")
            for name, tensor in part.items():
                if tuple(tensor.shape) != tuple(current[name].shape):
                    raise ValueError(
                        f"weight stream: {name!r} has shape {tuple(tensor.shape)}, "
                        f"the model expects {tuple(current[name].shape)}"
                    )
            with torch.no_grad():
                self.model.load_state_dict(dict(part), strict=False)
            seen.update(part)
        if len(seen) != len(current):
            missing = sorted(set(current) - seen)
            raise ValueError(f"weight stream ended without the keys {missing[:5]}")
        self._commit_version(version, interrupt)

    def _check_version(self, version: int) -> None:
        if version == self.version:
            raise ValueError(f"weights are already version {version}")
        if version in self._models:
            raise ValueError(f"version {version} is still in use by in-flight sequences")

    def _keep_old_model(self, interrupt: bool) -> bool:
        """Without an interrupt, in-flight sequences keep a copy of the weights they started
        with; the interrupt to commit with is returned. After a streamed update that failed
        part-way the model is half-loaded: a copy kept then stays the old weights, and
        without one (that update interrupted) the in-flight sequences are interrupted."""
        old = self.version
        if not interrupt and old in self.scheduler.versions_in_use():
            kept = self._models.get(old)
            if kept is self.model:
                self._models[old] = copy.deepcopy(self.model)
            elif kept is None:  # dropped by a failed interrupting update: nothing intact
                return True
            return False
        self._models.pop(old, None)
        return interrupt

    def _commit_version(self, version: int, interrupt: bool) -> None:
        if self.runner.graphs is not None:  # in-place loads keep them; moved tensors drop them
            self.runner.graphs.weights_updated()
        self.version = version
        self._models[version] = self.model
        if interrupt:
            self._stats["sequences_interrupted"] += self.scheduler.interrupt_all(version)
        self._stats["weight_updates"] += 1
        self._release_old_models()

    def _check_state_dict(self, state: dict[str, Tensor], strict: bool) -> None:
        current = self.model.state_dict()
        unexpected = sorted(set(state) - set(current))
        missing = sorted(set(current) - set(state))
        if strict and (unexpected or missing):
            raise ValueError(
                f"state_dict does not match the model: unexpected keys {unexpected[:5]}, "
                f"missing keys {missing[:5]}"
            )
        for name, tensor in state.items():
            if name in current and tuple(tensor.shape) != tuple(current[name].shape):
                raise ValueError(
                    f"state_dict[{name!r}] has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(current[name].shape)}"
                )

    def _release_old_models(self) -> None:
        if len(self._models) == 1 and self.version in self._models:
            return  # only the current weights: nothing to release (the common case)
        in_use = self.scheduler.versions_in_use() | {self.version}
        for v in [v for v in self._models if v not in in_use]:
            del self._models[v]

    def close(self) -> None:
        """Nothing to stop: the engine runs in its caller's thread (``RolloutBackend.close``)."""

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Counters and timings since construction."""
        st = dict(self._stats)
        st["forwards"] = self.runner.num_forwards
        steps = max(1, int(st["steps"]))
        st["mean_slot_utilisation"] = st["slot_steps"] / (steps * self.max_slots)
        busy = st["prefill_time_s"] + st["decode_time_s"] + st["sample_time_s"]
        st["tokens_per_s"] = st["tokens_generated"] / busy if busy > 0 else 0.0
        st["num_waiting"] = len(self.scheduler.waiting)
        st["num_running"] = len(self.scheduler.running)
        st["version"] = self.version
        st["weight_copies"] = len(self._models)
        st["kv_cache_bytes"] = self.kv_cache.memory_bytes()
        st["kv_cache_capacity"] = self.kv_cache.capacity
        st["cuda_graphs"] = self.runner.graphs is not None
        if self.runner.graphs is not None:
            st.update(self.runner.graphs.stats())
        for k in ("steps", "forwards", "tokens_generated", "prefill_tokens", "slot_steps"):
            st[k] = int(st[k])
        return st

    def report(self) -> EngineReport:
        """The rollout-backend report: counters, no spans (this process's clock is the caller's)."""
        return EngineReport(self.stats())

    def _to_sample(self, seq: Sequence, reason: FinishReason) -> Sample:
        req = seq.request
        return Sample(
            request_id=seq.request_id,
            prompt_ids=seq.tokens[: seq.prompt_len],
            response_ids=seq.tokens[seq.prompt_len :],
            behaviour_logprobs=seq.logprobs,
            versions=seq.versions,
            finish_reason=reason,
            group_id=req.group_id,
            metadata=req.metadata,
            num_interrupts=seq.num_interrupts,
            top_logprobs=seq.top,
        )


def run_until_done(
    step: Callable[[], list[Sample]],
    order: list[int],
    results: dict[int, Sample],
    finished: list[Sample],
) -> list[Sample]:
    """Step an engine until every request id in ``order`` has a sample (``results`` holds
    those already known, e.g. rejected requests); samples of other requests that finish
    meanwhile go to ``finished`` (the engine's next ``step``). Returns them in ``order``."""
    pending = set(order) - set(results)
    others: list[Sample] = []
    while pending:
        for s in step():
            if s.request_id in pending:
                results[s.request_id] = s
                pending.discard(s.request_id)
            else:
                others.append(s)
    finished.extend(others)
    return [results[rid] for rid in order]


def _input_vocab_size(model: torch.nn.Module, config: Any) -> int:
    """Rows of the input embedding (a HF model's), else ``config.vocab_size``."""
    get = getattr(model, "get_input_embeddings", None)
    rows = getattr(get() if get is not None else None, "num_embeddings", None)
    return int(rows if rows is not None else config.vocab_size)


def _output_vocab_size(model: torch.nn.Module, config: Any) -> int:
    """Outputs of the LM head (a HF model's), else ``config.vocab_size``."""
    get = getattr(model, "get_output_embeddings", None)
    cols = getattr(get() if get is not None else None, "out_features", None)
    return int(cols if cols is not None else config.vocab_size)


def _check_supported(config: Any) -> None:
    """The engine gives every layer full causal attention over the slot's cache."""
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise NotImplementedError(
            f"model has non-full-attention layers ({sorted(set(layer_types))}); the built-in "
            "engine supports full causal attention only"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError("encoder-decoder models are not supported by the rollout engine")
