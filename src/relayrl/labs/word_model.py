"""The lab's tiny model: a word-level tokenizer over the city language and a tiny Llama.

One token per word (punctuation included) with a BOS token: short sequences, and the BOS is
an attention sink, so a small model can count words (measured: see ``relayrl.labs.lab``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from relayrl.data import city_lang as cl

__all__ = ["SPECIAL_TOKENS", "build_word_model", "build_word_tokenizer"]

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]


# ----------------------------------------------------------------------------------- model


def build_word_tokenizer(words: Sequence[str]) -> PreTrainedTokenizerFast:
    """One token per whitespace-separated word, plus pad/bos/eos/unk; ``tok(text)`` starts
    with BOS; decoding joins words with single spaces, so decode(encode(s)) == s for text of
    the language."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(dict.fromkeys(words)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos = vocab["<bos>"]
    # Like Llama's tokenizers: encoding with special tokens starts with BOS (an attention sink
    # that lets a small model count words instead of averaging them).
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def build_word_model(
    out_dir: str | Path,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> Path:
    """A randomly initialised tiny Llama over the city-language vocabulary, saved in HF
    format (``AutoModelForCausalLM`` / ``AutoTokenizer`` load it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_word_tokenizer(cl.vocabulary())
    torch.manual_seed(seed)
    mcfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=4 * hidden_size,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForCausalLM(mcfg)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
