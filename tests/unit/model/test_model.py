"""Model layer: local loading, two+ architectures, padded logprobs, critic, checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.model import (
    ModelPathError,
    build_tiny_model,
    forward_logprobs,
    forward_values,
    load_causal_lm,
    load_critic,
    load_tokenizer,
    pack_batch,
)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_tiny_architectures_load_and_train(tmp_path, arch):
    path = build_tiny_model(tmp_path / arch, arch=arch, hidden_size=32)
    tok = load_tokenizer(path)
    model = load_causal_lm(path)
    assert model.config.model_type == arch
    prompts = [tok("12+3=").input_ids, tok("7+7=").input_ids]
    responses = [tok("15", add_special_tokens=False).input_ids + [tok.eos_token_id]] * 2
    batch = pack_batch(prompts, responses, tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        logp, _ = forward_logprobs(model, batch)
        loss = -(logp * batch.response_mask).sum() / batch.response_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_char_tokenizer_roundtrip(tmp_path, arch):
    """One token a character, whitespace included: a qwen2 directory's tokenizer is loaded as
    Qwen2Tokenizer (byte-level), which dropped ' ' and '\\n' from the plain character vocab."""
    path = build_tiny_model(tmp_path / "m", arch=arch, hidden_size=16)
    tok = load_tokenizer(path)
    text = "U: 12+34=46 ok\nA: "
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_padded_logprobs_equal_unpadded(tmp_path):
    """Left-padded prompts + right-padded responses give the logprobs of each lone sequence."""
    path = build_tiny_model(tmp_path / "m", hidden_size=32)
    model = load_causal_lm(path).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14]]
    responses = [[20, 21, 22, 23], [24], [25, 26]]
    batch = pack_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        logp, ent = forward_logprobs(model, batch, with_entropy=True)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            ids = torch.tensor([p + r])
            logits = model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
            ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            torch.testing.assert_close(logp[i, : len(r)], ref, atol=1e-5, rtol=0)
    assert batch.response_mask.sum() == 7
    assert ent is not None and torch.all(ent[batch.response_mask > 0] > 0)


def test_critic_starts_at_zero_and_roundtrips(tmp_path):
    path = build_tiny_model(tmp_path / "m", hidden_size=32)
    critic = load_critic(path)
    batch = pack_batch([[5, 6]], [[7, 8, 9]], pad_id=0)
    assert torch.all(forward_values(critic, batch) == 0)
    with torch.no_grad():
        critic.score.weight.fill_(0.01)
    critic.save_pretrained(tmp_path / "critic")
    reloaded = load_critic(tmp_path / "critic")
    torch.testing.assert_close(forward_values(reloaded, batch), forward_values(critic, batch))
    assert torch.all(forward_values(reloaded, batch) != 0)


def test_saved_tiny_model_loads_with_plain_transformers(tmp_path):
    path = build_tiny_model(tmp_path / "m", hidden_size=16)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.config.vocab_size == len(load_tokenizer(path))


def test_missing_model_dir_is_a_clear_error(tmp_path):
    with pytest.raises(ModelPathError, match="model directory not found"):
        load_causal_lm(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelPathError, match="no config.json"):
        load_tokenizer(tmp_path / "empty")
