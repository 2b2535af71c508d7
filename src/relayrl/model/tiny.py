"""Tiny models with a character tokenizer, built locally (no hub downloads).

The demo and the tests use these; they are saved with ``save_pretrained`` so that they load
through exactly the same path as a user's model (``AutoModelForCausalLM`` / ``AutoTokenizer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
DEFAULT_CHARS = (
    "0123456789+-*/=?.,:;!()<>[]{}'\"_ \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
)

Arch = Literal["llama", "qwen2", "gpt2"]

# transformers loads the tokenizer of every ``model_type: qwen2`` directory as Qwen2Tokenizer,
# whatever its tokenizer_config says; that byte-level pre-tokenizer spells whitespace as these
# characters, so a Qwen2's character vocabulary has them too (else ' ' and '\n' are dropped).
BYTE_LEVEL_WHITESPACE = {" ": "\u0120", "\n": "\u010a", "\t": "\u0109"}


def build_char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, plus pad/bos/eos/unk."""
    unique = list(dict.fromkeys(chars))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + unique)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: Arch = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    chars: str = DEFAULT_CHARS,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised tiny causal LM + char tokenizer and save both to ``out_dir``.

    Sizes are configurable; the default Llama has ~0.1M parameters and runs fast on one CPU core.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if arch == "qwen2":
        chars += "".join(v for k, v in BYTE_LEVEL_WHITESPACE.items() if k in chars)
    tokenizer = build_char_tokenizer(chars)
    ids = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    inter = intermediate_size or 4 * hidden_size
    torch.manual_seed(seed)
    model: PreTrainedModel
    cfg: PretrainedConfig
    if arch == "llama":
        cfg = LlamaConfig(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            intermediate_size=inter,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            **ids,
        )
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            intermediate_size=inter,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            **ids,
        )
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=inter,
            n_positions=max_position_embeddings,
            **ids,
        )
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose llama, qwen2 or gpt2")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
