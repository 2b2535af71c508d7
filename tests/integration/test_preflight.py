"""Start-up checks (``relayrl.controller.preflight``, ``load_tokenizer``): a user's own model
and data that cannot work end in one line naming the key or file, exit 2, before any step.

The model is what a new user brings: a GPT-2 built with plain ``transformers`` (128
positions) and a byte-level BPE tokenizer trained with ``tokenizers``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from helpers import byte_bpe_tokenizer
from relayrl.cli import main

LONG = " ".join(f"{i}+{i}" for i in range(40))  # 159 tokens with byte_bpe_tokenizer()


def _gpt2(out: Path, tok: PreTrainedTokenizerFast, vocab: int) -> Path:
    cfg = GPT2Config(
        n_positions=128,
        n_embd=32,
        n_layer=1,
        n_head=2,
        vocab_size=vocab,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    GPT2LMHeadModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "0"}) + "\n" for p in prompts))
    return path


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """(root, the GPT-2, a copy without tokenizer files, one whose embedding is too small)."""
    root = tmp_path_factory.mktemp("preflight")
    tok = byte_bpe_tokenizer()
    assert len(tok(LONG).input_ids) == 159
    gpt2 = _gpt2(root / "gpt2", tok, len(tok))
    notok = root / "notok"
    notok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(gpt2 / name, notok / name)
    small = _gpt2(root / "small_vocab", tok, 200)
    _jsonl(root / "short.jsonl", [f"{i}+{i}=" for i in range(6)])
    _jsonl(root / "mixed.jsonl", [f"{i}+{i}=" for i in range(6)] + [LONG])
    _jsonl(root / "long.jsonl", [LONG, LONG + " 1+1", LONG + " 2+2"])
    return root, gpt2, notok, small


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err.strip()


def _train_args(root: Path, model: Path, data: str, *extra: str) -> list[str]:
    return [
        f"model.path={model}",
        f"run_dir={root / 'runs' / data}",
        "data.task=jsonl",
        f"data.train_path={root / data}",
        f"data.eval_path={root / 'short.jsonl'}",
        "algo.group_size=2",
        "algo.prompts_per_step=2",
        "train.steps=1",
        "threads=1",
        "logging.progress=false",
        "logging.tensorboard=false",
        *extra,
    ]


def _empty_config(root: Path) -> str:
    cfg = root / "empty.yaml"
    cfg.write_text("{}\n")
    return str(cfg)


def test_prompt_longer_than_the_context_is_a_config_error(capsys, user):
    """Was ``IndexError: index out of range in self`` from actor.compute_logprobs, exit 1."""
    root, gpt2, _, _ = user
    args = _train_args(root, gpt2, "mixed.jsonl", "data.max_prompt_tokens=512")
    rc, err = _cli(capsys, "train", _empty_config(root), *args)
    assert rc == 2
    assert err == (
        f"relayrl train: error: data.max_prompt_tokens=512 + rollout.max_tokens=8 exceeds the "
        f"128-token context of model.path {gpt2} (n_positions in its config.json), and 1 of 7 "
        f"prompts in {root / 'mixed.jsonl'} are longer than 120 tokens (longest 159): set "
        "data.max_prompt_tokens <= 120 (context - rollout.max_tokens) to skip them, or lower "
        "rollout.max_tokens"
    )
    assert not (root / "runs" / "mixed.jsonl").exists()  # refused before anything is written


def test_max_tokens_beyond_the_context_is_a_config_error(capsys, user):
    """Was accepted and quietly capped at context - prompt length (101 tokens)."""
    root, gpt2, _, _ = user
    args = _train_args(root, gpt2, "short.jsonl", "rollout.max_tokens=100000")
    rc, err = _cli(capsys, "train", _empty_config(root), *args)
    assert rc == 2
    assert err == (
        "relayrl train: error: rollout.max_tokens=100000 leaves no room for a prompt in the "
        f"128-token context of model.path {gpt2} (n_positions in its config.json): set "
        "rollout.max_tokens <= 127 and data.max_prompt_tokens <= 128 - rollout.max_tokens"
    )


def test_model_without_tokenizer_files_names_the_directory(capsys, user):
    """Was ``<train file>: no usable prompts`` (an empty tokenizer of one token)."""
    root, _, notok, _ = user
    want = (
        f"{notok}: the tokenizer files are missing (looked for tokenizer.json, tokenizer.model, "
        "vocab.json, vocab.txt, spiece.model, sentencepiece.bpe.model, *.tiktoken); save the "
        "model's tokenizer there with tokenizer.save_pretrained()"
    )
    for command in ("train", "eval"):
        rc, err = _cli(
            capsys, command, _empty_config(root), *_train_args(root, notok, "short.jsonl")
        )
        assert (rc, err) == (2, f"relayrl {command}: error: {want}")


def test_tokenizer_larger_than_the_embedding(capsys, user):
    root, _, _, small = user
    rc, err = _cli(capsys, "train", _empty_config(root), *_train_args(root, small, "short.jsonl"))
    assert rc == 2
    assert err == (
        f"relayrl train: error: {small}: the tokenizer has 300 tokens but the model's embedding "
        "has 200 rows (vocab_size in config.json): token ids 200..299 would be out of range"
    )


def test_every_prompt_too_long_says_so(capsys, user):
    """Was ``long.jsonl: no usable prompts``."""
    root, gpt2, _, _ = user
    args = _train_args(root, gpt2, "long.jsonl", "data.max_prompt_tokens=100")
    rc, err = _cli(capsys, "train", _empty_config(root), *args)
    assert rc == 2
    assert err == (
        f"relayrl train: error: 3 of 3 prompts in {root / 'long.jsonl'} are longer than "
        "data.max_prompt_tokens=100 tokens (longest 163)"
    )


def test_eval_reads_only_the_eval_set(capsys, user):
    """``relayrl eval`` named (and failed on) data.train_path, a file it does not use (here
    one that does not exist). Short eval prompts also pass the context check with a
    data.max_prompt_tokens over the context."""
    root, gpt2, _, _ = user
    args = _train_args(root, gpt2, "no_such_train.jsonl", "data.max_prompt_tokens=512")
    rc = main(["eval", _empty_config(root), *args])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    assert "greedy pass rate on 6 held-out prompts" in out


def test_filter_prompt_without_room_for_the_answer(capsys, user, tmp_path):
    """Was accepted: the engine cut the answers of long prompts short without a word."""
    root, gpt2, _, _ = user
    args = [*_train_args(root, gpt2, "mixed.jsonl", "data.max_prompt_tokens=512")]
    rc, err = _cli(
        capsys,
        "filter",
        _empty_config(root),
        *args,
        "--input",
        str(root / "mixed.jsonl"),
        "--output",
        str(tmp_path / "kept.jsonl"),
        "--n",
        "2",
    )
    assert rc == 2
    assert err == (
        f"relayrl filter: error: 1 of 7 prompts in {root / 'mixed.jsonl'} are longer than 120 "
        "tokens, which leaves no room for rollout.max_tokens=8 in the 128-token context of "
        f"model.path {gpt2} (longest 159): set data.max_prompt_tokens <= 120"
    )
    assert not (tmp_path / "kept.jsonl").exists()


def _sft_config(root: Path, model: Path, data: Path) -> str:
    cfg = root / "sft.yaml"
    cfg.write_text(
        f"model_path: {model}\noutput_dir: {root / 'sft_out'}\ntask: jsonl\n"
        f"train_path: {data}\nsteps: 1\nbatch_size: 2\nthreads: 1\nprogress: false\n"
    )
    return str(cfg)


def test_sft_checks_the_context_and_the_tokenizer(capsys, user):
    """SFT on an example longer than the context was an IndexError in the forward."""
    root, gpt2, notok, _ = user
    data = root / "sft.jsonl"
    data.write_text(
        json.dumps({"prompt": "1+1=", "response": "2"})
        + "\n"
        + json.dumps({"prompt": LONG, "response": "0"})
        + "\n"
    )
    rc, err = _cli(capsys, "sft", _sft_config(root, gpt2, data))
    assert rc == 2
    assert err == (
        f"relayrl sft: error: 1 of 2 SFT examples in {data} are longer than the 128-token "
        f"context of model_path {gpt2} (n_positions in its config.json) (longest 161 tokens: "
        "prompt + response + EOS)"
    )
    rc, err = _cli(capsys, "sft", _sft_config(root, notok, data))
    assert rc == 2 and err.startswith(f"relayrl sft: error: {notok}: the tokenizer files are")
    assert not (root / "sft_out").exists()


def test_sft_validation_prompt_without_room_for_the_answer(capsys, user):
    """Was scored as a failure without a word (the engine refused the prompt)."""
    root, gpt2, _, _ = user
    data = root / "sft_short.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    val = _jsonl(root / "val.jsonl", ["1+1=", LONG])
    cfg = _sft_config(root, gpt2, data)
    rc, err = _cli(capsys, "sft", cfg, f"val_path={val}", "eval_every=1", "val_reward=exact_match")
    assert rc == 2
    assert err == (
        f"relayrl sft: error: 1 of 2 validation prompts in {val} are longer than 125 tokens, "
        "which leaves no room for a 3-token answer in the 128-token context of model_path "
        f"{gpt2} (n_positions in its config.json) (longest 159)"
    )
    assert not (root / "sft_out").exists()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("env.factory", "nope", "env.factory: unknown environment 'nope'"),
        (
            "env.factory",
            "no_such_module_xyz:make",
            "env.factory: cannot import 'no_such_module_xyz'",
        ),
        ("env.factory", "json:no_such_env", "env.factory: 'json' has no callable 'no_such_env'"),
        ("env.agent.function", "no_such_module_xyz:solve", "env.agent.function: cannot import"),
    ],
)
def test_unknown_environment_or_agent_is_caught_before_the_run(capsys, user, key, value, message):
    """Was found when the schedule was built: after the models loaded and the run directory
    was written (i20e)."""
    root, gpt2, _, _ = user
    args = _train_args(root, gpt2, "short.jsonl", f"{key}={value}")
    rc, err = _cli(capsys, "train", _empty_config(root), *args)
    assert rc == 2
    assert err.startswith(f"relayrl train: error: {message}"), err
    assert "\n" not in err
    assert not (root / "runs" / "short.jsonl").exists()  # refused before anything is written
    rc, err = _cli(capsys, "eval", _empty_config(root), *args)
    assert rc == 2 and err.startswith(f"relayrl eval: error: {message}"), err


def test_vllm_kv_cache_that_cannot_hold_one_sequence(capsys, user):
    """Was vLLM's own multi-line refusal after the model loaded (SmolLM2-135M: 8192 positions
    need 0.352 GiB of fp32 KV, the default rollout.vllm_kv_cache_gib is 0.25)."""
    root, gpt2, _, _ = user
    # 2 x 1 layer x 2 heads x 16 dims x 4 bytes = 256 bytes per token; 2**-16 GiB = 16384
    # bytes = 64 tokens (4 blocks of 16) < the 128-token context
    kv = "rollout.vllm_kv_cache_gib=0.0000152587890625"
    args = _train_args(root, gpt2, "short.jsonl", "rollout.backend=vllm", kv)
    rc, err = _cli(capsys, "train", _empty_config(root), *args)
    assert rc == 2
    assert err == (
        "relayrl train: error: rollout.vllm_kv_cache_gib=1.52587890625e-05 cannot hold one "
        f"128-token sequence of model.path {gpt2} (float32 KV needs 3.06e-05 GiB): set "
        "rollout.vllm_kv_cache_gib >= 3.06e-05 or rollout.max_model_len <= 64"
    )
    rc, err = _cli(capsys, "train", _empty_config(root), *args, "rollout.max_model_len=256")
    assert rc == 2
    assert err == (
        "relayrl train: error: rollout.max_model_len=256 exceeds the 128-token context of "
        f"model.path {gpt2} (n_positions in its config.json): set rollout.max_model_len <= 128 "
        "(null: the model's own)"
    )
    # the context the engine serves is what the prompts are checked against
    args = _train_args(root, gpt2, "short.jsonl", "rollout.max_model_len=64")
    rc, err = _cli(capsys, "train", _empty_config(root), *args, "rollout.max_tokens=64")
    assert rc == 2
    assert err == (
        "relayrl train: error: rollout.max_tokens=64 leaves no room for a prompt in the "
        "64-token context set by rollout.max_model_len: set rollout.max_tokens <= 63 and "
        "data.max_prompt_tokens <= 64 - rollout.max_tokens"
    )
