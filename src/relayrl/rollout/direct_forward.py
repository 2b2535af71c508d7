"""The split-attention forward of a Llama-family model without the ``nn.Module`` call machinery.

On CPU a decode step of a small model is mostly Python overhead: each ``Module.__call__``
(hook dispatch), ``transformers``' per-model wrappers (output capture, mask construction that
split attention then ignores, output dataclasses) cost more than the matmuls, so the tail of
a heavy-tailed rollout (a few long requests left) runs at a fraction of the full-batch rate
(figures: docs/measurements.md).

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

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from relayrl.rollout.cpu_kernels import varlen_decode
from relayrl.rollout.kv_cache import SlotKVCache

if TYPE_CHECKING:  # the static types of the modules read: Llama's (``SUPPORTED``'s others match)
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaDecoderLayer,
        LlamaForCausalLM,
        LlamaRMSNorm,
        LlamaRotaryEmbedding,
    )

SUPPORTED = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})
"""Model classes (by name) whose decoder layer is the one ``direct_logits`` runs."""


def supported(model: torch.nn.Module) -> bool:
    """Whether ``direct_logits`` computes this model's forward: a class in ``SUPPORTED``, a
    SiLU MLP, default rotary embedding, no sliding-window layers, no tensor-parallel split,
    plain ``nn.Linear`` projections (no adapter or quantised linear in their place)."""
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
    if inner is None or not all(hasattr(inner, n) for n in needed):
        return False
    embed = inner.embed_tokens  # a plain lookup (``max_norm`` would renormalise rows)
    if type(embed) is not torch.nn.Embedding or embed.max_norm is not None:
        return False
    return _plain_linears(model)


def _plain_linears(model: torch.nn.Module) -> bool:
    """Every projection ``direct_logits`` reads through ``_parameters["weight"]`` is a plain
    ``nn.Linear``. A subclass that adds to its product (a shift, an adapter term) would be
    computed without the addition, and while that term is zero (an adapter's
    initialisation) the first-use check cannot tell; wrappers that hold the weight elsewhere
    (peft's LoRA ``Linear``: ``base_layer``) are refused here too rather than by the
    check's failure."""
    try:
        mods = [model.lm_head]
        for la in _layers(model):
            mods += [la.q, la.k, la.v, la.o, la.gate, la.up, la.down]
    except AttributeError:
        return False
    return all(type(x) is torch.nn.Linear for x in mods)


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


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``LlamaRMSNorm.forward``: ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``.
    (``F.rms_norm`` gives the same bits but runs ~13 operations inside, two of them copies:
    slower here than these six.)"""
    dtype = x.dtype
    f32 = dtype == torch.float32  # then both casts return their input: skip their dispatch
    h = x if f32 else x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * (h if f32 else h.to(dtype))


@functools.cache
def _lanes_here() -> int:
    """``varlen_decode.aten_lanes()`` where the kernel library builds, else 0 (once)."""
    return varlen_decode.aten_lanes() if varlen_decode.available() else 0


def _c_norm_lanes(h: Tensor) -> int:
    """The vector width for ``varlen_decode.add_rms_norm`` on rows like ``h`` (float32 on
    the CPU, ``RMS_MAX_DIM`` wide at most, the kernel built, ATen's kernels known), else 0:
    torch's operations."""
    lanes = _lanes_here()
    dim = h.shape[-1]
    ok = (
        lanes
        and h.is_cpu
        and h.dtype == torch.float32
        and lanes <= dim <= varlen_decode.RMS_MAX_DIM
    )
    return lanes if ok else 0


def _add_norm(h: Tensor, b: Tensor | None, norm: LlamaRMSNorm, lanes: int) -> tuple[Tensor, Tensor]:
    """``h + b`` (the residual stream; ``b`` None: ``h``) and its RMSNorm: with ``lanes``
    (``_c_norm_lanes``) in one C call of the same bits (``varlen_decode.add_rms_norm``),
    else torch's seven operations."""
    # an RMSNorm's weight is always registered (torch types _parameters values as Optional);
    # no runtime cast here: this runs per layer on every decode step
    weight: Tensor = norm._parameters["weight"]  # type: ignore[assignment]
    eps = norm.variance_epsilon
    if lanes and weight.dtype == torch.float32 and weight.is_contiguous():
        return varlen_decode.add_rms_norm(h, b, weight, eps, lanes, checked=False)
    if b is not None:
        h = h + b
    return h, _rms(h, weight, eps)


def _lin(x: Tensor, layer: torch.nn.Linear) -> Tensor:
    """``nn.Linear.forward`` (``F.linear``), its tensors from ``_parameters`` (no
    ``Module.__getattr__``; a linear's weight is always registered, its bias may be None)."""
    p = layer._parameters
    return F.linear(x, p["weight"], p.get("bias"))  # type: ignore[arg-type]  # per step: no cast


FUSE_MAX_ELEMENTS = 1 << 20
"""Linears that read the same input run as one GEMM on the CPU when their weights hold at
most this many elements together: there a call's fixed cost is most of its time (the default
bench model runs 15 GEMMs of 64 x <=256 per forward); the price is a copy of those weights,
which larger models are not worth."""

_FUSED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[list, Tensor, Tensor | None]] = (
    weakref.WeakKeyDictionary()
)


def _fused(mods: tuple[torch.nn.Linear, ...]) -> tuple[Tensor, Tensor | None] | None:
    """``cat`` of the weights (and biases) of ``mods``, linears of the same input: one
    ``F.linear`` gives their outputs side by side, each column the same dot product as its
    own linear's (MKL's per-element sum does not depend on the other columns: checked for
    every row count 1..600 and several widths under each ``MKL_CBWR`` code path; the
    first-use check compares the logits anyway). Rebuilt when any tensor changes (its
    version counter: in-place updates such as ``load_state_dict``; its storage:
    ``.data =``, ``.to()``). None: not fused (an accelerator, weights too large, mixed
    dtypes or biases; or autograd is on: the copy is not a leaf of the graph)."""
    if torch.is_grad_enabled():
        return None
    params = [m._parameters for m in mods]
    weights = [cast(Tensor, p["weight"]) for p in params]  # linears': always registered
    biases = [p.get("bias") for p in params]
    present: list[Tensor] = [b for b in biases if b is not None]
    tensors = weights + present
    try:
        key = [(t._version, t.data_ptr()) for t in tensors]
    except RuntimeError:  # inference tensors have no version counter: changes go unseen
        return None
    hit = _FUSED.get(mods[0])
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    w0 = weights[0]
    if (
        not w0.is_cpu
        or sum(w.numel() for w in weights) > FUSE_MAX_ELEMENTS
        or any(t.dtype != w0.dtype or t.device != w0.device for t in tensors)
        or len({b is None for b in biases}) > 1
        or any(w.dim() != 2 or w.shape[1] != w0.shape[1] for w in weights)
    ):
        return None
    weight = torch.cat(weights)
    bias = torch.cat(present) if present else None  # all biases or none (checked above)
    _FUSED[mods[0]] = (key, weight, bias)
    return weight, bias


class _Layer(NamedTuple):
    """One decoder layer's modules, looked up once per model (their tensors each call: a
    weight update or ``.to()`` changes them in place, and ``_parameters`` is one dict read)."""

    attn: LlamaAttention
    norm1: LlamaRMSNorm
    q: torch.nn.Linear
    k: torch.nn.Linear
    v: torch.nn.Linear
    o: torch.nn.Linear
    norm2: LlamaRMSNorm
    gate: torch.nn.Linear
    up: torch.nn.Linear
    down: torch.nn.Linear
    kv_heads: int
    widths: tuple[int, int, int]  # q, k, v projection widths
    intermediate: int  # the MLP's width
    # gate and up as one GEMM: only where ``silu`` on the gate's columns (a strided view)
    # runs the same vector code as on its own contiguous output: ATen's elementwise loops
    # take 2 x vector width elements at a time and leave the rest to scalar code (another
    # exp), so each row must hold whole blocks (multiples of 64 floats: up to 512-bit vectors)
    fuse_mlp: bool


_LAYERS: weakref.WeakKeyDictionary[torch.nn.Module, list[_Layer]] = weakref.WeakKeyDictionary()


def _layers(model: torch.nn.Module) -> list[_Layer]:
    """``model.model.layers[: num_hidden_layers]``' modules, once per model."""
    layers = _LAYERS.get(model)
    if layers is None:
        lm = cast("LlamaForCausalLM", model)
        decoder = cast("list[LlamaDecoderLayer]", list(lm.model.layers))
        layers = _LAYERS[model] = [
            _Layer(
                a := layer.self_attn,
                layer.input_layernorm,
                a.q_proj,
                a.k_proj,
                a.v_proj,
                a.o_proj,
                layer.post_attention_layernorm,
                (m := layer.mlp).gate_proj,
                m.up_proj,
                m.down_proj,
                a.k_proj.out_features // a.head_dim,
                (a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features),
                inter := m.gate_proj.out_features,
                inter % 64 == 0 and m.up_proj.out_features == inter,
            )
            for layer in decoder[: lm.config.num_hidden_layers]
        ]
    return layers


_SIGNS: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}


def _rotary(
    position_ids: Tensor, rotary: LlamaRotaryEmbedding, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``LlamaRotaryEmbedding.forward`` (default rope) for positions ``[N]``: ``cos`` and a
    signed ``sin`` ``[N, 1, d]`` such that ``apply_rotary_pos_emb`` is

        x * cos + rotate_half(x) * sin  ==  x * cos + roll(x, d/2) * sin_signed

    with ``sin_signed = sin * [-1] * d/2 + [1] * d/2``: ``rotate_half(x) = cat(-x2, x1)`` and
    ``roll(x, d/2) = cat(x2, x1)``, and ``(-a) * b == a * (-b)`` exactly in IEEE arithmetic,
    so the same bits with three fewer operations per rotated tensor (no slices, negation, cat).
    Products by ``attention_scaling`` = 1 and casts to the dtype it has are skipped (exact)."""
    inv_freq: Tensor = rotary.inv_freq
    if inv_freq.dtype != torch.float32:
        inv_freq = inv_freq.float()
    freqs = position_ids.float().unsqueeze(-1) * inv_freq  # [N, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    scaling = rotary.attention_scaling
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    if dtype != torch.float32:
        cos, sin = cos.to(dtype), sin.to(dtype)
    d = emb.shape[-1]
    key = (d, dtype, emb.device)
    signs = _SIGNS.get(key)
    if signs is None:
        half = d // 2
        signs = _SIGNS[key] = torch.tensor([-1.0] * half + [1.0] * (d - half), dtype=dtype).to(
            emb.device
        )
    return cos.unsqueeze(1), (sin * signs).unsqueeze(1)


def _rope(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """``apply_rotary_pos_emb`` on ``x`` ``[N, heads, d]`` (see ``_rotary``)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def direct_logits(
    model: torch.nn.Module,
    ids: Tensor,
    position_ids: Tensor,
    cache: SlotKVCache,
    attention: Callable[..., tuple[Tensor, object]],
    mask: Tensor | None,
    rows: Tensor | None = None,
    varlen: varlen_decode.Rows | None = None,
    logits_out: Tensor | None = None,
) -> Tensor:
    """fp32 logits ``[N, vocab]`` of ``ids`` ``[N]`` or ``[N, 1]`` at ``position_ids`` (same
    shape), each row one token, as ``model(..., logits_to_keep=1).logits[:, -1]`` computes;
    with ``rows`` (indices) only those rows' logits ``[len(rows), vocab]``: the final norm
    runs on every row, the LM head on those alone.

    Keys/values: through ``cache.update`` and attention by ``attention`` (the runner's split
    attention) on the module path's 4D shapes; or, with ``varlen`` (every row a
    ``varlen_decode`` row: the runner's float32 CPU steps), rotated, written into the
    cache's arenas and attended in one call of ``varlen.attend``. Rows are
    2D ``[N, hidden]`` throughout (the module path's ``[N, 1, hidden]``: the same elements
    in the same order, so the same bits).

    ``logits_out`` (fp32, the logits' shape): the logits are written there (the conversion
    to fp32 is that copy) and it is returned: a captured step's static output
    (``relayrl.rollout.cuda_graphs``)."""
    lm = cast("LlamaForCausalLM", model)  # a ``supported`` model
    inner = lm.model
    ids = ids.view(-1)
    h = F.embedding(ids, inner.embed_tokens._parameters["weight"])  # type: ignore[arg-type]
    cos, sin = _rotary(position_ids.view(-1), inner.rotary_emb, h.dtype)
    n = ids.shape[0]
    lanes = _c_norm_lanes(h)
    pending: Tensor | None = None  # the last block's output, added to h by the next norm
    for layer in _layers(model):
        attn = layer.attn
        d = attn.head_dim
        h, x = _add_norm(h, pending, layer.norm1, lanes)
        qkv = _fused((layer.q, layer.k, layer.v))
        if qkv is not None:  # one GEMM, its output's columns split (views)
            q, k, v = F.linear(x, *qkv).split(layer.widths, dim=1)
        else:
            q, k, v = (_lin(x, m) for m in (layer.q, layer.k, layer.v))
        if varlen is not None:  # rotary, cache writes and attention in one C call
            keys, values = cache.arenas(attn.layer_idx, layer.kv_heads, d, q)
            out = varlen.attend(q, k, v, cos, sin, keys, values, attn.scaling, checked=False)
        else:
            q = _rope(q.view(n, -1, d), cos, sin)  # [N, H, d]
            k = _rope(k.view(n, -1, d), cos, sin)  # [N, Hkv, d]
            k4, v4 = cache.update(k.unsqueeze(2), v.view(n, -1, 1, d), attn.layer_idx)
            out, _ = attention(
                attn, q.unsqueeze(2), k4, v4, mask, dropout=0.0, scaling=attn.scaling
            )
        h, x = _add_norm(h, _lin(out.reshape(n, -1), layer.o), layer.norm2, lanes)
        gate_up = _fused((layer.gate, layer.up)) if layer.fuse_mlp else None
        if gate_up is not None:
            gate, up = F.linear(x, *gate_up).split(layer.intermediate, dim=1)
        else:
            gate, up = _lin(x, layer.gate), _lin(x, layer.up)
        pending = _lin(F.silu(gate) * up, layer.down)
    _, h = _add_norm(h, pending, inner.norm, lanes)
    if rows is not None:
        h = h.index_select(0, rows)
    logits = _lin(h, lm.lm_head)
    if logits_out is not None:
        return logits_out.copy_(logits)
    return logits if logits.dtype == torch.float32 else logits.float()
