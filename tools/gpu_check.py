"""GPU check: a few GRPO steps of a ~50M-param Llama with bf16 + FSDP2 + the own engine.

    make gpu-check                       # CUDA: 1 rank, and 2 ranks when two GPUs exist
                                         # (no CUDA: fails with one line, exit 2)
    PYTHONPATH=src python tools/gpu_check.py --device cpu --hidden 128 --layers 2   # CPU

Per step: the engine (rank 0) samples groups of completions, a synthetic reward (share of one
token in the response) gives GRPO advantages, the trainer recomputes the logprobs of the
sampled tokens (FSDP2, bf16 compute, fp32 master weights) and updates, then the full weights
are gathered bucket by bucket and loaded into the engine. Asserted: the behaviour logprobs of
the engine and the trainer's agree in bf16 (mean |diff| <= --tol-mean, max <= --tol-max over
response tokens) and every step's loss is finite. Prints one JSON line per world size:
generation and training tokens/s, peak GPU memory (CUDA), weight-sync seconds, and the
device the engine computed on (``engine_device``: rank 0's, where its model, KV cache and
sampler are). The vLLM backend is not exercised yet (``vllm`` says whether it is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """One rank: build roles, run the steps, rank 0 writes its figures to ``out``."""
    import torch
    import torch.distributed as dist

    from relayrl.algos import compute_grpo
    from relayrl.config import RunConfig, load_config
    from relayrl.model import load_tokenizer
    from relayrl.rollout import GenerationRequest, RolloutEngine
    from relayrl.rollout.types import SamplingParams
    from relayrl.workers import Experience
    from relayrl.workers.build import build_actor, engine_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    # CUDA tensors over NCCL, CPU ones (the loss counts, the forward-count agreement) over gloo
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={args.model}",
            "model.dtype=bfloat16",
            "model.fsdp.enabled=true",
            f"model.device={args.device}",
            "algo.mini_batches=1",
            "optim.lr=1e-4",
            f"rollout.max_tokens={args.max_tokens}",
        ],
    )
    tok = load_tokenizer(args.model)
    actor = build_actor(cfg, args.model, rank, world)
    engine = None
    # a collective: every rank gathers; the model lands on this rank's device
    gen_model = engine_model(cfg.model, actor, args.model, rank=rank)
    if rank == 0:
        engine = RolloutEngine(
            gen_model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
    target = tok.convert_tokens_to_ids("1")
    g = torch.Generator().manual_seed(1)
    figures: dict[str, list[float]] = {"gen_tps": [], "train_tps": [], "sync_s": []}
    diffs_mean, diffs_max = [], []
    for step in range(args.steps):
        samples = None
        if rank == 0:
            assert engine is not None
            prompts = [torch.randint(4, len(tok), (8,), generator=g).tolist() for _ in range(8)]
            reqs = [
                GenerationRequest(p, SamplingParams(max_tokens=args.max_tokens), group_id=i)
                for i, p in enumerate(prompts)
                for _ in range(args.group)
            ]
            t0 = time.perf_counter()
            samples = engine.generate(reqs)
            dt = time.perf_counter() - t0
            figures["gen_tps"].append(sum(len(s.response_ids) for s in samples) / dt)
        box = [samples]
        dist.broadcast_object_list(box, src=0)
        exp = Experience.from_samples(box[0], tok.pad_token_id)
        exp = exp.select(list(range(rank, len(exp), world)))
        mask = exp.response_mask
        resp = exp.batch.response_ids
        score = ((resp == target).float() * mask).sum(1) / mask.sum(1).clamp(min=1)
        rewards = torch.zeros_like(mask)
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards[torch.arange(len(exp)), last] = score + 0.01 * last.float()
        exp.advantages, _ = compute_grpo(rewards, mask, exp.group_index)
        t0 = time.perf_counter()
        exp.old_logprobs = actor.compute_logprobs(exp)
        d = (exp.old_logprobs - exp.behaviour_logprobs).abs() * mask
        diffs_mean.append(float(d.sum() / mask.sum()))
        diffs_max.append(float(d.max()))
        stats = actor.update(exp)
        train_s = time.perf_counter() - t0
        figures["train_tps"].append(float(exp.batch.attention_mask.sum()) * world / train_s)
        assert all(v == v for v in stats.values()), stats  # no NaN
        t0 = time.perf_counter()
        state = actor.state_dict()  # gathered bucket by bucket; full on rank 0
        if engine is not None:
            engine.update_weights(state, version=step + 1)
        figures["sync_s"].append(time.perf_counter() - t0)
    if rank == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        res = {
            "world": world,
            "device": args.device,
            "engine_device": str(engine.device) if engine is not None else None,
            "gen_tokens_per_s": round(sum(figures["gen_tps"]) / args.steps, 1),
            "train_tokens_per_s": round(_mean(figures["train_tps"][1:] or figures["train_tps"]), 1),
            "weight_sync_s": round(max(figures["sync_s"]), 4),
            "peak_gpu_mem_gib": round(peak, 3) if peak is not None else None,
            "logprob_abs_diff_mean": round(max(diffs_mean), 5),
            "logprob_abs_diff_max": round(max(diffs_max), 5),
            "tol_mean": args.tol_mean,
            "tol_max": args.tol_max,
            "vllm": _vllm_state(),
        }
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def _mean(xs: list[float]) -> float:
    """Mean (the first training step, with its warm-up, is left out when there are more)."""
    return sum(xs) / len(xs)


def _vllm_state() -> str:
    try:
        import vllm  # noqa: F401

        import relayrl.rollout.vllm_backend  # noqa: F401
    except ImportError:
        return "not installed (skipped)"
    return "installed (not exercised by this check yet)"


def main() -> int:
    import torch
    import torch.multiprocessing as mp
    from scale import build_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--world", type=int, default=0, help="ranks (default: 1, and 2 on 2+ GPUs)")
    p.add_argument("--tol-mean", type=float, default=0.02)
    p.add_argument("--tol-max", type=float, default=0.5)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}); on the CPU run `make gpu-check DEVICE=cpu`",
            file=sys.stderr,
        )
        return 2
    worlds = [args.world] if args.world else [1]
    if not args.world and args.device == "cuda" and torch.cuda.device_count() >= 2:
        worlds.append(2)
    ok = True
    with tempfile.TemporaryDirectory(prefix="relayrl-gpu-check-") as work:
        args.model, params = build_model(Path(work) / "model", args.hidden, args.layers)
        args.model = str(args.model)
        for world in worlds:
            out = str(Path(work) / f"world{world}.json")
            mp.spawn(run_rank, args=(world, _free_port(), args, out), nprocs=world, join=True)
            res = json.loads(Path(out).read_text())
            res["params"] = params
            res["ok"] = (
                res["logprob_abs_diff_mean"] <= args.tol_mean
                and res["logprob_abs_diff_max"] <= args.tol_max
            )
            ok &= res["ok"]
            print(json.dumps(res), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
