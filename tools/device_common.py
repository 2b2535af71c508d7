"""Plumbing and models shared by the prepared GPU run's steps (``tools/device_run.py``).

Importing it puts ``src/`` and ``bench/`` on the path and sets ``CUBLAS_WORKSPACE_CONFIG``
(deterministic cuBLAS for the bit-exact resume check) before torch starts CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

# cuBLAS deterministic for the bit-exact resume check; set before CUDA starts
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

GB = 1e9
RESULTS: dict[str, Any] = {}


# --------------------------------------------------------------------------- plumbing
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, reps: int = 1) -> float:
    """Mean seconds of ``fn`` over ``reps`` calls (device work included)."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / reps


def _r(x: float, n: int = 4) -> float:
    return float(f"{x:.{n}g}")


class Run:
    """Steps in order; each one's figures (or its error) written to ``out`` as it ends."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.device = torch.device(args.device)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="relayrl-device-run-"))
        self.t0 = time.time()
        RESULTS.update(started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), steps={})

    def save(self) -> None:
        RESULTS["wall_s"] = round(time.time() - self.t0, 1)
        steps = RESULTS["steps"].values()
        RESULTS["passed"] = sum(1 for s in steps if s.get("ok"))
        RESULTS["failed"] = [k for k, s in RESULTS["steps"].items() if not s.get("ok")]
        (self.out / "device_run.json").write_text(json.dumps(RESULTS, indent=1))

    def step(self, name: str, fn: Callable[[Run], dict[str, Any]]) -> None:
        if self.args.only and name not in self.args.only.split(","):
            return
        print(f"[{time.time() - self.t0:6.1f}s] {name} ...", flush=True)
        t0 = time.time()
        rec: dict[str, Any] = {"start_s": round(t0 - self.t0, 1)}
        try:
            figures = fn(self)
            rec.update(figures)
            rec["ok"] = bool(figures.get("ok", True))
        except Exception as e:  # noqa: BLE001 - one failing step must not stop the others
            rec["ok"] = False
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-4000:]
        finally:
            if self.device.type == "cuda":
                rec.setdefault("peak_gib", _r(torch.cuda.max_memory_allocated() / 2**30))
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        rec["seconds"] = round(time.time() - t0, 1)
        RESULTS["steps"][name] = rec
        print(f"  -> {'PASS' if rec['ok'] else 'FAIL'} {json.dumps(rec)[:1500]}", flush=True)
        self.save()


# --------------------------------------------------------------------------- models
def small_llama(run: Run) -> Path:
    """A ~30M Llama with the character tokenizer (cached in the work dir)."""
    from scale import build_model

    path = run.work / "llama"
    if not (path / "config.json").is_file():
        hidden, layers = (512, 8) if run.device.type == "cuda" else (64, 2)
        build_model(path, hidden, layers)
    return path


QWEN2 = {
    # Qwen2.5-0.5B / 1.5B shapes (tied embeddings), random init
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
}


def qwen2_dir(run: Run, size: str) -> Path:
    """A config-only Qwen2 directory (tokenizer: the character one; vocab 151936)."""
    from transformers import Qwen2Config

    from relayrl.model.tiny import build_char_tokenizer

    path = run.work / f"qwen2-{size}"
    if not (path / "config.json").is_file():
        tok = build_char_tokenizer()
        cfg = Qwen2Config(
            vocab_size=151936 if size != "tiny" else 512,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            use_sliding_window=False,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            **QWEN2[size],
        )
        path.mkdir(parents=True)
        cfg.save_pretrained(path)
        tok.save_pretrained(path)
    return path


def qwen2_model(path: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Random-init model of a config-only directory, built on ``device`` (no disk weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def run_config(path: Path, device: torch.device, *extra: str) -> Any:
    from relayrl.config import RunConfig, load_config

    return load_config(
        RunConfig,
        None,
        [f"model.path={path}", f"model.device={device.type}", "algo.mini_batches=1", *extra],
    )


def random_batch(
    vocab: int, rows: int, prompt: int, response: int, seed: int = 0, ragged: bool = False
) -> Any:
    """``rows`` random prompt+response rows of ``prompt`` and ``response`` tokens; ``ragged``:
    row i is ``i % 4`` prompt tokens and ``3 * (i % 3)`` response tokens shorter (padded)."""
    from relayrl.model import pack_batch
    from relayrl.workers import Experience

    g = torch.Generator().manual_seed(seed)
    cut_p = [i % 4 if ragged else 0 for i in range(rows)]
    cut_r = [3 * (i % 3) if ragged else 0 for i in range(rows)]
    prompts = [torch.randint(3, vocab, (prompt - c,), generator=g).tolist() for c in cut_p]
    resps = [torch.randint(3, vocab, (response - c,), generator=g).tolist() for c in cut_r]
    exp = Experience(pack_batch(prompts, resps, 0))
    exp.advantages = torch.randn(rows, 1, generator=g).expand(-1, response).clone()
    return exp


# --------------------------------------------------------------------------- steps
