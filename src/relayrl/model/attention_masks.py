"""Attention masks for the trainers' forwards, built without reading the device.

Given a 2D padding mask ``m`` [B, T] (1 on real tokens), transformers' SDPA path first asks
whether it may skip the mask and use SDPA's ``is_causal`` (flash kernels): it may when no
position is padding, and it finds out with ``m.sum() == m.numel()`` read on the host
(``masking_utils._ignore_causal_mask_sdpa``), one device -> host sync per forward on a GPU.
Otherwise it builds the 4D boolean mask

    allowed[b, 0, q, k] = (k <= q) and m[b, k]

The trainers know on the host whether a micro-batch has padding (the batch is cut and padded
there before it moves to the device, ``TokenBatch.padded``), so for a padded batch they give
the model that 4D mask themselves, built on the device by transformers' own ``sdpa_mask`` with
the skip turned off: the mask transformers would have built, without the read. This needs
SDPA (eager attention never reads) and one kind of attention in every layer (sliding-window
or chunked layers take other masks, which a single 4D mask would override).

A batch without padding keeps the 2D mask and its one read: that read is what lets SDPA run
``is_causal`` (flash) kernels, and without a mask transformers reads ``position_ids`` instead
(``find_packed_sequence_indices``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.masking_utils import sdpa_mask


def host_padding(attention_mask: Tensor, known: bool | None = None) -> bool | None:
    """Whether ``attention_mask`` [B, T] has a padding (0) position: ``known`` if given, else
    computed when the mask is on the host (free there), else None (it would take a read)."""
    if known is not None:
        return known
    if attention_mask.device.type == "cpu":
        return not bool(attention_mask.all())
    return None


def one_mask_for_all_layers(config: object) -> bool:
    """Whether every attention layer of ``config``'s model takes the same causal mask: all
    ``layer_types`` are ``full_attention``, or, without ``layer_types``, no ``sliding_window``
    and no ``attention_chunk_size``."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    no_window = getattr(config, "sliding_window", None) is None
    return no_window and getattr(config, "attention_chunk_size", None) is None


def full_mask(model: torch.nn.Module, attention_mask: Tensor) -> Tensor:
    """The mask to give ``model`` for a padded batch: the 4D boolean causal-and-padding mask
    [B, 1, T, T] on ``attention_mask``'s device when the model runs SDPA with one mask for all
    layers (module docstring), else ``attention_mask`` itself (2D)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not one_mask_for_all_layers(
        config
    ):
        return attention_mask
    b, t = attention_mask.shape
    mask = sdpa_mask(
        batch_size=b,
        q_length=t,
        kv_length=t,
        attention_mask=attention_mask.to(torch.bool),
        allow_is_causal_skip=False,
        device=attention_mask.device,
    )
    assert mask is not None  # with the skip off, sdpa_mask always builds the mask
    return mask
