"""The split-attention forward of a Llama-family model without the ``nn.Module`` call machinery.

On CPU a decode step of a small model is mostly Python overhead: each ``Module.__call__``
(hook dispatch), ``transformers``' per-model wrappers (output capture, mask construction that
split attention then ignores, output dataclasses) cost more than the matmuls. Measured on the
tiny bench model (2 layers, hidden 64) before this path: a step at 1 row took ~60% of a step at
32 rows, so the tail of a heavy-tailed rollout (a few long requests left) ran at a fraction of
the full-batch rate.

``direct_logits`` runs the same operations, in the same order, on the same parameters as
``LlamaForCausalLM.forward`` (embedding, per layer RMSNorm -> q/k/v -> rotary -> cache write ->
attention -> o_proj + residual -> RMSNorm -> SwiGLU MLP + residual, final norm, ``lm_head`` on
the last position), calling ``F.linear`` / ``F.silu`` and the model's own rotary module, so its
logits are bitwise those of the module path. ``ModelRunner`` uses it only for model classes in
``SUPPORTED`` whose config has nothing it does not implement (``supported``), with no forward
hooks anywhere in the model (a hook would not run), and after a first-use self-check that its
logits equal the module path's exactly (``ModelRunner._check_direct``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})
"""Model classes (by name) whose decoder layer is the one ``direct_logits`` runs."""


def supported(model: torch.nn.Module) -> bool:
    """Whether ``direct_logits`` computes this model's forward: a class in ``SUPPORTED``, a
    SiLU MLP, default rotary embedding, no sliding-window layers, no tensor-parallel split."""
    if type(model).__name__ not in SUPPORTED:
        return False
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "hidden_act", None) != "silu":
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return False
    if getattr(cfg, "pretraining_tp", 1) not in (1, None):
        return False
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        return False
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    return inner is not None and all(hasattr(inner, n) for n in needed)


_MODULES: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def has_hooks(model: torch.nn.Module) -> bool:
    """Any forward (pre-)hook on the model or a submodule, or a global one. (The module list
    is taken once per model: ``model.modules()`` per step cost ~7% of a 2-row step.)"""
    from torch.nn.modules import module as _m

    if _m._global_forward_hooks or _m._global_forward_pre_hooks:
        return True
    mods = _MODULES.get(model)
    if mods is None:
        mods = _MODULES[model] = list(model.modules())
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def _rms(x: Tensor, norm: torch.nn.Module) -> Tensor:
    """``LlamaRMSNorm.forward``: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``."""
    dtype = x.dtype
    f32 = dtype == torch.float32  # then both casts return their input: skip their dispatch
    h = x if f32 else x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + norm.variance_epsilon)
    return norm.weight * (h if f32 else h.to(dtype))


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _lin(x: Tensor, layer: torch.nn.Module) -> Tensor:
    return F.linear(x, layer.weight, layer.bias)


_LAYERS: weakref.WeakKeyDictionary[torch.nn.Module, list[torch.nn.Module]] = (
    weakref.WeakKeyDictionary()
)


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.model.layers[: num_hidden_layers]`` as a list, once per model (slicing a
    ``ModuleList`` builds a new one each time)."""
    layers = _LAYERS.get(model)
    if layers is None:
        layers = _LAYERS[model] = list(model.model.layers)[: model.config.num_hidden_layers]
    return layers


def direct_logits(
    model: torch.nn.Module,
    ids: Tensor,
    position_ids: Tensor,
    cache: object,
    attention: Callable[..., tuple[Tensor, object]],
    mask: Tensor,
    rows: Tensor | None = None,
) -> Tensor:
    """fp32 logits ``[N, vocab]`` of ``ids`` ``[N, 1]`` at ``position_ids`` ``[N, 1]``, each row
    one token, keys/values written through ``cache.update``, attention by ``attention`` (the
    runner's split attention), as ``model(..., logits_to_keep=1).logits[:, -1]`` computes;
    with ``rows`` (indices) only those rows' logits ``[len(rows), vocab]``: the final norm
    runs on every row, the LM head on those alone."""
    inner = model.model
    h = inner.embed_tokens(ids)
    # LlamaRotaryEmbedding.forward (default rope), then apply_rotary_pos_emb's unsqueeze(1)
    rotary = inner.rotary_emb
    freqs = position_ids[..., None].float() * rotary.inv_freq.to(dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    scaling = rotary.attention_scaling
    cos = (emb.cos() * scaling).to(dtype=h.dtype).unsqueeze(1)
    sin = (emb.sin() * scaling).to(dtype=h.dtype).unsqueeze(1)
    n = ids.shape[0]
    for layer in _layers(model):
        attn = layer.self_attn
        d = attn.head_dim
        residual = h
        x = _rms(h, layer.input_layernorm)
        q = _lin(x, attn.q_proj).view(n, 1, -1, d).transpose(1, 2)
        k = _lin(x, attn.k_proj).view(n, 1, -1, d).transpose(1, 2)
        v = _lin(x, attn.v_proj).view(n, 1, -1, d).transpose(1, 2)
        q = (q * cos) + (_rotate_half(q) * sin)
        k = (k * cos) + (_rotate_half(k) * sin)
        k, v = cache.update(k, v, attn.layer_idx)  # type: ignore[attr-defined]
        out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        out = out.reshape(n, 1, -1).contiguous()
        h = residual + _lin(out, attn.o_proj)
        residual = h
        x = _rms(h, layer.post_attention_layernorm)
        mlp = layer.mlp
        h = residual + _lin(F.silu(_lin(x, mlp.gate_proj)) * _lin(x, mlp.up_proj), mlp.down_proj)
    h = _rms(h, inner.norm)[:, -1]
    if rows is not None:
        h = h.index_select(0, rows)
    return _lin(h, model.lm_head).float()
