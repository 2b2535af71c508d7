"""Model specifications: parameter count and the shapes that size the KV cache.

A spec either comes from a preset (:data:`MODELS`), is written by hand, or is read from a
Hugging Face ``config.json`` (:meth:`ModelSpec.from_hf_config`), whose parameter count is
computed from the shapes:

    params = V*h*(1 if tied else 2)
           + L * (h*H*d + 2*h*K*d + H*d*h          # attention q, k, v, o
                  + (3 if gated MLP else 2)*h*I)    # MLP (SwiGLU has three matrices)

with vocabulary ``V``, hidden size ``h``, layers ``L``, heads ``H``, KV heads ``K`` (GQA),
head dim ``d``, MLP width ``I`` (norms and biases are < 0.1% and left out). Qwen2.5-7B gives
7.62e9, Llama-2-70B 6.90e10.

KV cache per token (bytes) = ``2 (K and V) * L * K * d * kv_bytes``.
Memory held for RL (mixed-precision Adam): 16 bytes per trained parameter (bf16 weight and
gradient, fp32 master weight, Adam m and v), 2 bytes per frozen (inference-only) parameter.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "FROZEN_BYTES_PER_PARAM",
    "MODELS",
    "TRAINED_BYTES_PER_PARAM",
    "ModelSpec",
    "get_model",
    "params_from_shapes",
]

TRAINED_BYTES_PER_PARAM = 16
"""bf16 weight (2) + bf16 gradient (2) + fp32 master (4) + Adam m (4) + Adam v (4)."""
FROZEN_BYTES_PER_PARAM = 2
"""bf16 weight only."""


def params_from_shapes(
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
    tied: bool,
    gated: bool = True,
) -> int:
    """Parameter count of a decoder-only transformer (formula in the module docstring)."""
    attn = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim
    mlp = (3 if gated else 2) * hidden * intermediate
    emb = vocab * hidden * (1 if tied else 2)
    return int(emb + layers * (attn + mlp))


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only LM as the time and memory models see it.

    Attributes:
        name: label.
        params: parameter count (exact when read from a config; nominal, e.g. 7e9, in presets
            whose name is a bare size like ``7b``).
        layers, hidden, heads, kv_heads: transformer shapes (``kv_heads < heads`` is GQA).
        head_dim: per-head width (default ``hidden // heads``).
        vocab: vocabulary size.
        bytes_per_param: bytes of one weight at inference (2 = bf16).
        kv_bytes: bytes of one cached K or V element (2 = bf16).
    """

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int = 0
    vocab: int = 32000
    bytes_per_param: float = 2.0
    kv_bytes: float = 2.0

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ValueError(f"model {self.name}: params must be > 0, got {self.params}")
        for f in ("layers", "hidden", "heads", "kv_heads"):
            if getattr(self, f) < 1:
                raise ValueError(f"model {self.name}: {f} must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads must be a multiple of kv_heads")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def weight_bytes(self) -> float:
        """Bytes of the inference weights: ``params * bytes_per_param``."""
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes per cached token: ``2 * layers * kv_heads * head_dim * kv_bytes``."""
        return 2.0 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    def forward_flops_per_token(self) -> float:
        """``2 * params`` FLOP per token (one multiply-add per weight)."""
        return 2.0 * self.params

    def train_flops_per_token(self) -> float:
        """``6 * params`` FLOP per token (forward 2 + backward 4)."""
        return 6.0 * self.params

    def memory_bytes(self, trained: bool) -> float:
        """16 bytes/param if trained with mixed-precision Adam, else 2 bytes/param."""
        per = TRAINED_BYTES_PER_PARAM if trained else FROZEN_BYTES_PER_PARAM
        return self.params * per

    def with_params(self, params: float, name: str | None = None) -> ModelSpec:
        return replace(self, params=float(params), name=name or self.name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(
        cls, source: str | Path | dict[str, Any], name: str | None = None
    ) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a path to it, its directory, or the dict).

        Understands the Llama/Qwen/Mistral family (``hidden_size``, ``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``) and GPT-2
        style names (``n_embd``, ``n_layer``, ``n_head``, MLP ``4 * n_embd``, ungated).
        """
        if isinstance(source, dict):
            cfg = source
            label = name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "hf-model")
        else:
            p = Path(source)
            if p.is_dir():
                p = p / "config.json"
            if not p.is_file():
                raise ValueError(f"no Hugging Face config.json at {source}")
            try:
                cfg = json.loads(p.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}: not valid JSON ({exc.msg})") from None
            label = name or p.parent.name
        if "text_config" in cfg and "hidden_size" not in cfg:
            cfg = cfg["text_config"]

        def get(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if cfg.get(k) is not None:
                    return cfg[k]
            if default is None:
                raise ValueError(f"config.json lacks {' / '.join(keys)}")
            return default

        hidden = int(get("hidden_size", "n_embd", "d_model"))
        layers = int(get("num_hidden_layers", "n_layer", "num_layers"))
        heads = int(get("num_attention_heads", "n_head"))
        kv_heads = int(get("num_key_value_heads", "num_kv_heads", default=heads))
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        gpt2_style = "n_embd" in cfg and "intermediate_size" not in cfg
        intermediate = int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
        vocab = int(get("vocab_size", default=32000))
        tied = bool(cfg.get("tie_word_embeddings", gpt2_style))
        params = params_from_shapes(
            layers=layers,
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=intermediate,
            vocab=vocab,
            tied=tied,
            gated=not gpt2_style,
        )
        return cls(label, float(params), layers, hidden, heads, kv_heads, head_dim, vocab)


def _arch(
    name: str,
    layers: int,
    hidden: int,
    heads: int,
    kv: int,
    inter: int,
    vocab: int,
    tied: bool,
    params: float | None = None,
) -> ModelSpec:
    hd = hidden // heads
    n = params or params_from_shapes(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv,
        head_dim=hd,
        intermediate=inter,
        vocab=vocab,
        tied=tied,
    )
    return ModelSpec(name, float(n), layers, hidden, heads, kv, hd, vocab)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        _arch("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, True),
        _arch("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, True),
        _arch("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, False),
        _arch("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, False),
        _arch("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, False),
        _arch("codellama-34b", 48, 8192, 64, 8, 22016, 32000, False),
        _arch("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, False),
        # Nominal sizes: the round parameter counts used in back-of-envelope examples.
        _arch("1.5b", 28, 1536, 12, 2, 8960, 151936, True, params=1.5e9),
        _arch("7b", 28, 3584, 28, 4, 18944, 152064, False, params=7e9),
        _arch("13b", 40, 5120, 40, 40, 13824, 32000, False, params=13e9),
        _arch("34b", 48, 8192, 64, 8, 22016, 32000, False, params=34e9),
        _arch("70b", 80, 8192, 64, 8, 28672, 32000, False, params=70e9),
    ]
}


def get_model(name: str) -> ModelSpec:
    """A preset by name, or a spec read from a local HF model directory / config.json path."""
    key = name.strip().lower()
    if key in MODELS:
        return MODELS[key]
    p = Path(name)
    if p.exists():
        return ModelSpec.from_hf_config(p)
    raise ValueError(
        f"unknown model {name!r}: give a preset ({', '.join(MODELS)}) or a model directory"
    )
