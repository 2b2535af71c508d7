"""Shared builders for integration tests: a tiny SFT-warm-started model, small run configs."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from relayrl.config import ArithmeticConfig, DataConfig, RunConfig, SFTConfig, load_config
from relayrl.controller.sft import run_sft
from relayrl.data.prompts import PromptSource
from relayrl.model import build_tiny_model, load_tokenizer

ARITH = dict(min_operand=0, max_operand=99, operators=["+"], num_operands=2)
TEST_SEED = int(os.environ.get("RELAYRL_TEST_SEED", "0"))
"""Seed of the SFT fixture and of every RL test run (conftest.py)."""
SFT_TARGET = 0.35
"""Validation greedy pass rate at which the fixture's SFT stops (checked every 20 steps)."""
SMALL_STEP = (
    "data.eval_size=4",
    "rollout.max_tokens=6",
    "algo.prompts_per_step=4",
    "algo.group_size=4",
    "train.save_every=0",
)
"""Overrides of a small, quick RL step (4 prompts x 4 samples of 6 tokens, 4 held out, no
periodic checkpoint), for tests of what happens around a step rather than of learning."""


def make_sft_model(root: Path, seed: int = 0, target: float = SFT_TARGET) -> Path:
    """Tiny Llama, SFT on 2-digit addition until the greedy pass rate on a validation stream
    reaches ``target``: mid-way through learning the carry, where RL improves it fast.

    The fixture stops at a quality, not a step count: after a fixed number of steps the tiny
    model's pass rate depends on the machine's floating point (measured 12% on one CPU and 38%
    on another after the same 520 steps), so every RL test downstream would start elsewhere.
    The validation stream excludes the RL held-out set (``data.eval_size=200``, run seed
    ``seed``) that the tests' ``eval_before`` / ``eval_after`` are measured on."""
    base = build_tiny_model(root / "base", hidden_size=96, seed=seed)
    data = DataConfig(arithmetic=ArithmeticConfig(**ARITH), eval_size=200)
    held_out = {p.record.prompt for p in PromptSource(data, load_tokenizer(base), seed).eval_set()}
    cfg = SFTConfig(
        seed=seed,
        model_path=str(base),
        output_dir=str(root / "sft"),
        arithmetic=ArithmeticConfig(**ARITH),
        steps=3000,
        eval_every=20,
        eval_size=200,
        target_pass_rate=target,
        threads=1,
        progress=False,
    )
    out = run_sft(cfg, exclude_prompts=held_out)
    reached = out.get("sft/val_pass_rate", 0.0)
    if reached < target:
        raise RuntimeError(
            f"SFT fixture stopped at {reached:.2f} < target {target} after "
            f"{int(out['sft/steps'])} steps"
        )
    return root / "sft"


def run_config(model: Path, run_dir: Path, *overrides: str) -> RunConfig:
    return recipe_config(None, model, run_dir, f"seed={TEST_SEED}", *overrides)


def recipe_config(recipe: Path | None, model: Path, run_dir: Path, *overrides: str) -> RunConfig:
    """``recipe`` (None: the defaults) on ``model`` into ``run_dir``, one thread, quiet."""
    return load_config(
        RunConfig,
        recipe,
        [
            f"model.path={model}",
            f"run_dir={run_dir}",
            "threads=1",
            "logging.progress=false",
            "logging.tensorboard=false",
            *overrides,
        ],
    )


def slow_on_prompt(
    prompt: str, completion: str, sample: dict, slow: str = "", delay_s: float = 0.0
):
    """The arithmetic reward, ``delay_s`` late for the first sample of the one prompt
    ``slow``: a straggler group that tests force while the reward service's other worker
    goes on scoring (its workers import this from here)."""
    import time

    from relayrl.reward.functions import arithmetic

    if sample.get("prompt") == slow and sample.get("sample_index") == 0:
        time.sleep(delay_s)
    return arithmetic(prompt, completion, sample)


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module (the scripts are not a package)."""
    path = Path(__file__).resolve().parents[2] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def join_gloo(rank: int, world: int, init_file: str) -> None:
    """Start a spawned rank: one torch thread (the ranks share the machine's cores) and the
    gloo process group of ``world`` ranks that meet at the file ``init_file`` (a file
    rendezvous, not a TCP port: a port picked free here can be taken by another test process,
    the other xdist worker, before rank 0 listens on it)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def leave_process_group() -> None:
    """End a spawned rank: wait for every rank (``barrier``), destroy the process group,
    then leave without interpreter finalisation (``os._exit(0)``, streams flushed).

    A clean-clone run saw rank 1 of ``test_fsdp``'s fixture abort after the work was done
    (rank 0 had written all its results): "terminate called without an active exception",
    SIGABRT, in Gloo's teardown while rank 0 was still saving. Objects that outlive
    ``destroy_process_group`` (FSDP2 modules and their collectives' work handles) are freed
    during finalisation, where a Gloo thread can abort the process; skipping finalisation
    and leaving together removes both the race and that path."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def byte_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's scheme: tokens can split a character's bytes) trained on
    ``a+b=c`` sums, 300 ids with ``<pad>``, ``<eos>``, ``<unk>``."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator([f"{a}+{b}={a + b}" for a in range(50) for b in range(50)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def completion_parity(prompt: str, completion: str, sample: dict) -> float:
    """0 or 1, fixed by the completion's text (the low bit of its SHA-256): a reward that
    varies within a group even for an untrained model, so every GRPO step moves the weights."""
    import hashlib

    return float(hashlib.sha256(completion.encode()).digest()[0] % 2)
