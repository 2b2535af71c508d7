"""Pack prompt+response token ids into one padded batch, and per-token forward passes.

Layout (as in veRL): prompts are left-padded to ``P`` and responses right-padded to ``R``, so
every response starts at column ``P``. The logit that predicts response token ``t`` sits at
column ``P - 1 + t``. Position ids are recomputed from the attention mask so left padding
does not shift positions: a padded row gives the same logits as the unpadded sequence.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from relayrl.algos import entropy_from_logits, logprobs_from_logits
from relayrl.model.attention_masks import full_mask, host_padding
from relayrl.model.device import compute_context, model_device


@dataclass
class TokenBatch:
    """A padded batch of prompt+response sequences."""

    input_ids: Tensor  # [B, P+R] int64
    attention_mask: Tensor  # [B, P+R] int64
    position_ids: Tensor  # [B, P+R] int64
    prompt_width: int  # P
    response_ids: Tensor  # [B, R] int64 (pad where masked)
    response_mask: Tensor  # [B, R] float32, 1 on real response tokens
    padded: bool | None = None  # any padding position, known on the host; None: not recorded

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def has_padding(self) -> bool | None:
        """Whether any position is padding, without reading the device: ``padded`` if
        recorded, else computed from a host mask, else None."""
        return host_padding(self.attention_mask, self.padded)

    def select(self, index: Tensor | Sequence[int]) -> TokenBatch:
        idx = torch.as_tensor(index, dtype=torch.long)
        return TokenBatch(
            self.input_ids[idx],
            self.attention_mask[idx],
            self.position_ids[idx],
            self.prompt_width,
            self.response_ids[idx],
            self.response_mask[idx],
        )


def pack_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
) -> TokenBatch:
    """Left-pad prompts, right-pad responses, build masks and position ids."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    b = len(prompts)
    p = max(len(x) for x in prompts)
    r = max(1, max(len(x) for x in responses))
    input_ids = torch.full((b, p + r), pad_id, dtype=torch.long)
    attn = torch.zeros((b, p + r), dtype=torch.long)
    resp_mask = torch.zeros((b, r), dtype=torch.float32)
    for i, (pr, rs) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, p - len(pr) : p] = torch.as_tensor(list(pr), dtype=torch.long)
        attn[i, p - len(pr) : p] = 1
        if rs:
            input_ids[i, p : p + len(rs)] = torch.as_tensor(list(rs), dtype=torch.long)
            attn[i, p : p + len(rs)] = 1
            resp_mask[i, : len(rs)] = 1.0
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    return TokenBatch(input_ids, attn, position_ids, p, input_ids[:, p:].clone(), resp_mask)


def _response_hidden_slice(batch: TokenBatch) -> slice:
    p = batch.prompt_width
    r = batch.response_ids.shape[1]
    return slice(p - 1, p - 1 + r)


def upcast_logits(logits: Tensor) -> Tensor:
    """Logits in fp32 at least (bf16 / fp16 upcast; float64 stays float64): logprobs, entropies
    and losses are never computed in the parameter dtype."""
    return logits if logits.dtype == torch.float64 else logits.float()


def output_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype ``forward_logprobs`` / ``forward_values`` return for ``model``: float64 for a
    float64 model (its logits stay float64), fp32 otherwise (``upcast_logits``). Mixed
    precision autocasts only to bf16, so the parameters' dtype decides."""
    for p in model.parameters():
        if p.is_floating_point():
            return torch.float64 if p.dtype == torch.float64 else torch.float32
    return torch.float32


def _model_inputs(model: torch.nn.Module, batch: TokenBatch) -> dict[str, Tensor]:
    """The forward's inputs on the model's device; a padded batch's attention mask is the 4D
    one where that saves transformers a read of the device (``attention_masks``)."""
    dev = model_device(model)
    mask = batch.attention_mask.to(dev)
    return {
        "input_ids": batch.input_ids.to(dev),
        "attention_mask": full_mask(model, mask) if batch.has_padding() else mask,
        "position_ids": batch.position_ids.to(dev),
    }


LOGIT_CHUNK_ROWS = 256
"""Token positions per chunk of the logprob / entropy computation: one chunk's fp32 softmax is
256 x V x 4 bytes (48 MiB at a 49,152-token vocabulary)."""

_KEEPS_LOGITS: dict[type, bool] = {}


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes ``logits_to_keep`` (Hugging Face causal LMs since
    transformers 4.45; under a ``peft`` wrapper, the base model's forward decides)."""
    get_base = getattr(model, "get_base_model", None)
    base: torch.nn.Module = get_base() if callable(get_base) else model
    key = type(base)
    if key not in _KEEPS_LOGITS:
        params = inspect.signature(base.forward).parameters
        _KEEPS_LOGITS[key] = "logits_to_keep" in params
    return _KEEPS_LOGITS[key]


def _entropy_low_memory(logits: Tensor, temperature: float) -> Tensor:
    """``entropy_from_logits`` over chunks of ``LOGIT_CHUNK_ROWS`` positions; with gradients,
    each chunk is recomputed in the backward (``torch.utils.checkpoint``) instead of keeping its
    softmax: the saved memory is one chunk's, not B x R x V x 4 bytes twice over."""
    flat = logits.reshape(-1, logits.shape[-1])
    if not flat.requires_grad:
        return entropy_from_logits(logits, temperature=temperature)
    parts = [
        checkpoint(
            entropy_from_logits,
            flat[i : i + LOGIT_CHUNK_ROWS],
            LOGIT_CHUNK_ROWS,
            temperature,
            use_reentrant=False,
        )
        for i in range(0, flat.shape[0], LOGIT_CHUNK_ROWS)
    ]
    if not parts:
        return entropy_from_logits(logits, temperature=temperature)
    return torch.cat(parts).reshape(logits.shape[:-1])


def forward_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log pi(y_t | x, y_<t) of the response tokens (fp32), and optionally entropy.

    With temperature != 1 the logits are divided by it (chunk by chunk), matching the sampler.
    The forward runs on the model's device in its compute dtype (``relayrl.model.device``); the
    results are fp32 (float64 for a float64 model) on the batch's device, where the losses are
    computed.

    Memory (a 49k-token vocabulary makes the logits the largest tensors): the LM head runs on
    the last R + 1 positions only (``logits_to_keep``, where the model takes it), so the logits
    are B x (R + 1) x V, not B x (P + R) x V; logprobs and entropy are computed in chunks of
    ``LOGIT_CHUNK_ROWS`` positions, the entropy's softmax recomputed in the backward.
    Measured peak memory: ``bench/smollm2_memory.py`` (figures in docs/smollm2.md).
    """
    inputs = _model_inputs(model, batch)
    r = batch.response_ids.shape[1]
    keep = keeps_logits(model) and batch.prompt_width >= 1
    with compute_context(model):
        if keep:
            out = model(**inputs, use_cache=False, logits_to_keep=r + 1)
        else:
            out = model(**inputs, use_cache=False)
    logits = out.logits[:, :r] if keep else out.logits[:, _response_hidden_slice(batch)]
    logits = upcast_logits(logits)
    home = batch.response_ids.device
    ids = batch.response_ids.to(logits.device)
    logp = logprobs_from_logits(logits, ids, temperature, LOGIT_CHUNK_ROWS).to(home)
    ent = _entropy_low_memory(logits, temperature).to(home) if with_entropy else None
    return logp, ent


def forward_values(critic: torch.nn.Module, batch: TokenBatch) -> Tensor:
    """V(s_t) for each response token t: the critic's output at the state before token t
    (fp32 at least, on the batch's device)."""
    with compute_context(critic):
        out = critic(**_model_inputs(critic, batch))
    values = upcast_logits(out.logits[:, _response_hidden_slice(batch), 0])
    return values.to(batch.response_ids.device)
