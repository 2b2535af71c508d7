"""Training throughput and peak memory of the scale features, next to the planner's estimate.

For a randomly initialised Llama (default ~50M parameters) on this machine: training tokens/s
and peak RSS of one actor update for full fine-tuning in fp32, bf16 mixed precision (fp32
master weights), fp32 with activation checkpointing, LoRA, and FSDP2 over 2 gloo ranks (same
global batch). Each configuration runs in its own process (peak RSS is per process; FSDP2:
the larger rank). Ratios are within one run of this script, so the machine's speed cancels.

Next to each measured ``train_peak_mb`` (peak RSS above the RSS after loading) it prints
``planner_mb``, the calibrated training-memory model of ``relayrl.plan.memory``, and
``planner_uncalibrated_mb``, the guess it replaces (``4N + 12N/dp`` bytes of training state
+ ``tokens * hidden * (2 layers + 34)`` of activations, ``Planner.memory``). The model's
constants are fitted from two runs of this script at two micro-batch sizes (``--fit``).

    PYTHONPATH=src python bench/scale.py            # one JSON line
    PYTHONPATH=src python bench/scale.py --hidden 128 --layers 2   # a quick smoke
    PYTHONPATH=src python bench/scale.py --micro 8 > b8.json   # (and --micro 4 > b4.json)
    PYTHONPATH=src python bench/scale.py --fit b4.json b8.json # the fitted constants
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS: dict[str, tuple[str, ...]] = {
    "fp32": ("model.dtype=float32",),
    "bf16": ("model.dtype=bfloat16",),
    "fp32_ckpt": ("model.dtype=float32", "model.gradient_checkpointing=true"),
    "lora": (
        "model.dtype=float32",
        "model.lora.r=16",
        "model.lora.alpha=32",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
    ),
    "fsdp2_x2": ("model.dtype=float32", "model.fsdp.enabled=true"),
}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def build_model(out: Path, hidden: int, layers: int) -> tuple[Path, int]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from relayrl.model.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def _batch(model_dir: Path, rows: int, prompt: int, response: int, rank: int, world: int):
    import torch

    from relayrl.model import model_vocab_size, pack_batch
    from relayrl.workers import Experience

    g = torch.Generator().manual_seed(0)
    vocab = model_vocab_size(model_dir) or 32
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    resps = [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(rows)]
    keep = list(range(rank, rows, world))
    exp = Experience(pack_batch([prompts[i] for i in keep], [resps[i] for i in keep], 0))
    exp["advantages"] = torch.randn(len(keep), 1, generator=g).expand(-1, response).clone()
    return exp


def run_one(args: argparse.Namespace, rank: int = 0, world: int = 1) -> dict[str, float]:
    """Build the actor of ``args.config``, time ``args.steps`` updates after one warm-up."""
    import torch

    from relayrl.config import RunConfig, load_config
    from relayrl.workers.build import build_actor

    torch.set_num_threads(args.threads)
    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={args.model}",
            "algo.mini_batches=1",
            f"algo.micro_batch_size={args.micro}",
            "model.device=cpu",
            *CONFIGS[args.config],
        ],
    )
    actor = build_actor(cfg, args.model, rank, world)
    loaded = _current_rss_mb()
    exp = _batch(Path(args.model), args.rows, args.prompt, args.response, rank, world)
    actor.update(exp)  # warm-up (allocator, optimizer state)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        actor.update(exp)
    dt = (time.perf_counter() - t0) / args.steps
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    return {
        "step_s": dt,
        "tokens_per_s": args.rows * (args.prompt + args.response) / dt,
        "peak_rss_mb": _rss_mb(),
        "loaded_rss_mb": loaded,
        "train_peak_mb": _rss_mb() - loaded,
        "trainable_params": float(trainable),
    }


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = run_one(args, rank, world)
    Path(out, f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def run_fsdp(args: argparse.Namespace) -> dict[str, float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(dir=args.work) as out:
        mp.spawn(_rank, args=(2, port, args, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    worst = max(ranks, key=lambda r: r["peak_rss_mb"])
    step = max(r["step_s"] for r in ranks)
    return {
        **worst,
        "step_s": step,
        "tokens_per_s": args.rows * (args.prompt + args.response) / step,
    }


def planner_uncalibrated_mb(params: int, hidden: int, layers: int, tokens: int, dp: int) -> float:
    """The planner's first guess (``Planner.memory`` in relayrl.plan.search, tp = pp = 1):
    persistent ``4N + 12N/dp`` plus ``tokens * hidden * (2 layers + 34)`` activations."""
    return (4 * params + 12 * params / dp + tokens * hidden * (2 * layers + 34)) / 2**20


def fit_main(first: str, second: str) -> None:
    """Print the constants of ``relayrl.plan.memory`` fitted from two bench lines."""
    from relayrl.plan.memory import fit

    lines = [json.loads(Path(f).read_text().strip().splitlines()[-1]) for f in (first, second)]
    t = [ln["tokens_per_micro"] for ln in lines]
    model = fit(lines[0], lines[1], t[0], t[1])
    print(json.dumps({k: round(v, 4) for k, v in model.to_dict().items()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--fit", nargs=2, metavar=("FIRST", "SECOND"), help="fit the memory model")
    args = p.parse_args()
    if args.fit:
        fit_main(*args.fit)
        return
    if args.config:  # a child: one configuration, its figures as JSON on stdout
        res = run_fsdp(args) if args.config == "fsdp2_x2" else run_one(args)
        print(json.dumps(res))
        return
    from relayrl.plan.memory import CALIBRATED, estimate_mb

    work = Path(args.work or tempfile.mkdtemp(prefix="relayrl-scale-"))
    model, params = build_model(work / "model", args.hidden, args.layers)
    rows: dict[str, dict[str, float]] = {}
    for name in args.configs.split(","):
        cmd = [sys.executable, __file__, "--config", name, "--model", str(model)]
        cmd += ["--work", str(work)]
        for k in ("rows", "prompt", "response", "micro", "steps", "threads"):
            cmd += [f"--{k}", str(getattr(args, k))]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        res = json.loads(out.strip().splitlines()[-1])
        dp = 2 if name.startswith("fsdp") else 1
        tokens = args.micro * (args.prompt + args.response)
        res["planner_mb"] = estimate_mb(
            CALIBRATED, name, params, res["trainable_params"], args.hidden, args.layers, tokens
        )
        res["planner_uncalibrated_mb"] = planner_uncalibrated_mb(
            params, args.hidden, args.layers, tokens, dp
        )
        rows[name] = {k: round(v, 3) for k, v in res.items()}
    base = rows.get("fp32")
    if base:
        for r in rows.values():
            r["speed_vs_fp32"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["train_mem_vs_fp32"] = round(r["train_peak_mb"] / max(base["train_peak_mb"], 1e-9), 3)
    tokens = args.micro * (args.prompt + args.response)
    head = {"params": params, "hidden": args.hidden, "layers": args.layers}
    print(json.dumps({**head, "tokens_per_micro": tokens, **rows}))


if __name__ == "__main__":
    main()
