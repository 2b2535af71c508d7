"""Shared set-up of the vLLM backend's tests (``test_vllm_backend*.py``): whether vLLM imports,
the tiny models vLLM's CPU attention runs (2 heads of 32: it needs a head size in {32, 64, ...},
the default tiny model's 16 is not supported), in-process ``VllmEngine`` s on them, and the
trainer's view of logprobs under temperature + nucleus filtering."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout_helpers import EOS, PAD

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # ImportError, or a broken install (a CUDA torchvision, say)
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm is not installed (the relayrl[vllm] extra: make test-vllm)"
)

KV_GIB = 1 / 16
TOL = 1e-4


def build(root: Path, arch: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    """A tiny ``arch`` model of 2 heads of 32 under ``root`` (built once per directory): its
    path and the loaded HF model (eval mode)."""
    from relayrl.model.loading import load_causal_lm
    from relayrl.model.tiny import build_tiny_model

    out = root / f"{arch}-{seed}"
    if not (out / "config.json").exists():
        build_tiny_model(out, arch=arch, seed=seed, num_heads=2, num_kv_heads=1)
    return out, load_causal_lm(out).eval()


@contextmanager
def vllm_engines(root: Path, archs: list[str]) -> Iterator[dict[str, tuple[Any, Any]]]:
    """arch -> (HF model, VllmEngine on it), one engine per architecture (4 slots, 1/16 GiB of
    KV cache), closed on leaving."""
    from relayrl.rollout.vllm_backend import VllmEngine

    out = {}
    try:
        for arch in archs:
            path, model = build(root, arch)
            engine = VllmEngine(
                path, eos_token_id=EOS, pad_token_id=PAD, max_slots=4, kv_cache_gib=KV_GIB
            )
            out[arch] = (model, engine)
        yield out
    finally:
        for _, engine in out.values():
            engine.close()


def fresh(engine: Any, model: torch.nn.Module) -> int:
    """Put ``model``'s weights back under a new version (tests share one engine)."""
    assert not engine.has_unfinished()
    engine.update_weights(model.state_dict(), version=engine.version + 1, interrupt=True)
    return engine.version


@torch.no_grad()
def filtered_recompute(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float, top_p: float
) -> torch.Tensor:
    """The trainer's view of logprobs under temperature + nucleus (renormalised) filtering; the
    own sampler's rule (drop a token once the mass before it reaches top_p)."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    scaled = logits / temperature
    out = []
    for row, tok in zip(scaled, response, strict=True):
        probs = row.softmax(-1)
        sorted_p, order = probs.sort(descending=True)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        kept = order[keep].tolist()
        # NaN for a token outside this model's nucleus (sampled under other weights)
        lp = torch.log_softmax(row[kept], -1)[kept.index(tok)] if tok in kept else torch.nan
        out.append(torch.as_tensor(lp))
    return torch.stack(out)
