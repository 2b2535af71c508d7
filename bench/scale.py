"""Training throughput and peak memory of the scale features, next to the planner's estimate.

For a randomly initialised Llama (default ~50M parameters) on this machine: training tokens/s
and peak RSS of one actor update for full fine-tuning in fp32, bf16 mixed precision (fp32
master weights), fp32 with activation checkpointing, LoRA, and FSDP2 over 2 gloo ranks (same
global batch). Each configuration runs in its own process (peak RSS is per process; FSDP2:
the larger rank). Ratios are within one run of this script, so the machine's speed cancels.

Next to each measured ``train_peak_mb`` (peak RSS above the RSS after loading) it prints
``planner_mb``, the two-phase training-memory model of ``relayrl.plan.memory`` (its peak less
the weights), and ``planner_uncalibrated_mb``, the first guess (``4N + 12N/dp`` bytes of
training state + ``tokens * hidden * (2 layers + 34)`` of activations).

``--memory`` measures what that model is fitted on: for each model size (``--sizes``
``HxLxV``) and configuration, in a fresh process, the live bytes of torch's CPU allocator (the
profiler's memory events) at the peak of the backward phase (AdamW state present, the
gradients of an earlier micro-batch held) and of the optimizer step, at each micro-batch size
of ``--tokens``; it fits the coefficients on ``--fit-sizes`` x ``--fit-tokens`` (the
``--holdout-configs`` never), prints the table and one JSON line with the out-of-sample error.

    PYTHONPATH=src python bench/scale.py            # one JSON line
    PYTHONPATH=src python bench/scale.py --hidden 128 --layers 2   # a quick smoke
    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/scale.py --memory --rows-file rows.jsonl
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
    "bf16_ckpt": ("model.dtype=bfloat16", "model.gradient_checkpointing=true"),
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


def build_model(out: Path, hidden: int, layers: int, vocab: int | None = None) -> tuple[Path, int]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from relayrl.model.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(
        vocab_size=vocab or len(tok),
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
    exp.advantages = torch.randn(len(keep), 1, generator=g).expand(-1, response).clone()
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


# -- the two-phase memory measurement (``--memory``) ---------------------------------------

PHASES = ("phase.backward", "phase.optimizer")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard (DTensor)
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _phase_peaks(prof) -> dict[str, tuple[int, str]]:
    """Peak of the allocator's live bytes (relative to the profile's start) inside each
    ``record_function`` window of :data:`PHASES`, from the profiler's memory events, and the
    innermost autograd / aten op running at that instant (where the peak is)."""
    import bisect

    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ops = [e for e in events if e.name() != "[memory]" and e.name() not in PHASES]
    times = [t for t, _ in mem]
    level, running = [], 0
    for _, nb in mem:
        running += nb
        level.append(running)
    out: dict[str, tuple[int, str]] = {}
    for e in events:
        if e.name() not in PHASES:
            continue
        lo = bisect.bisect_left(times, e.start_ns())
        hi = bisect.bisect_right(times, e.end_ns())
        start = level[lo - 1] if lo > 0 else 0
        peak, at = start, e.start_ns()
        for i in range(lo, hi):
            if level[i] > peak:
                peak, at = level[i], times[i]
        inner = [o for o in ops if o.start_ns() <= at <= o.end_ns()]
        where = " > ".join(o.name() for o in sorted(inner, key=lambda o: o.start_ns())[-2:])
        out[e.name()] = (peak, where)
    missing = set(PHASES) - set(out)
    if missing:
        raise RuntimeError(f"profiler trace lacks the phases {sorted(missing)}")
    return out


def measure_phases(
    args: argparse.Namespace, rank: int = 0, world: int = 1
) -> list[dict[str, float]]:
    """One configuration (``args.config``) of one model: for each micro-batch of
    ``args.tokens_list`` tokens, the live allocator bytes at the peak of the backward (with the
    gradients of an earlier micro-batch held: zeros) and of the optimizer step (AdamW state
    present: one step was taken first), measured with the profiler's memory events."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from relayrl.config import RunConfig, load_config
    from relayrl.workers.build import build_actor

    torch.set_num_threads(args.threads)
    seq = args.prompt + args.response
    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={args.model}",
            "algo.mini_batches=1",
            "algo.micro_batch_size=1024",
            "model.device=cpu",
            *CONFIGS[args.config.replace("_foreach", "")],
        ],
    )
    actor = build_actor(cfg, args.model, rank, world)
    if args.config.endswith("_foreach"):  # CUDA's default AdamW implementation, on the CPU
        for g in actor.optimizer.param_groups:
            g["foreach"] = True
    model = actor.model
    trained = [p for p in model.parameters() if p.requires_grad]

    def hold_grads() -> None:
        for p in trained:
            p.grad = torch.zeros_like(p)

    hold_grads()
    actor._clip_and_step()  # step 1: AdamW's m and v exist from here on
    params = sum(_full_numel(p) for p in model.parameters())
    out = []
    for tokens in args.tokens_list:
        rows = tokens // seq
        exp = _batch(Path(args.model), rows, args.prompt, args.response, 0, 1)
        norm = actor._loss_norm(exp)
        model.train()
        hold_grads()
        gc.collect()
        state = [t for st in actor.optimizer.state.values() for t in st.values()]
        state = [t for t in state if isinstance(t, torch.Tensor)]
        base = _storage_bytes(
            [*model.parameters(), *model.buffers(), *[p.grad for p in trained], *state]
        )
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with record_function(PHASES[0]):
                actor._micro_step(exp, norm)
            with record_function(PHASES[1]):
                actor._clip_and_step()
        peaks = _phase_peaks(prof)
        del exp, prof
        out.append(
            {
                "config": args.config,
                "tokens": rows * seq,
                "params": float(params),
                "trainable": float(sum(_full_numel(p) for p in trained)),
                "largest_trained": float(max(_full_numel(p) for p in trained)),
                "response_share": args.response / seq,
                "base_mb": base / 2**20,
                "backward_mb": (base + peaks[PHASES[0]][0]) / 2**20,
                "optimizer_mb": (base + peaks[PHASES[1]][0]) / 2**20,
                "backward_peak_at": peaks[PHASES[0]][1],
            }
        )
    return out


def _full_numel(p) -> int:
    return int(p.numel())  # a DTensor's numel is the full tensor's


def _phase_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    Path(out, f"rank{rank}.json").write_text(json.dumps(measure_phases(args, rank, world)))
    dist.destroy_process_group()


def measure_phases_fsdp(args: argparse.Namespace) -> list[dict[str, float]]:
    """:func:`measure_phases` on 2 gloo ranks (FSDP2), each rank the same micro-batch; the
    larger rank's peaks."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory(dir=Path(args.model).parent) as out:
        mp.spawn(_phase_rank, args=(2, port, args, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    return [max(rs, key=lambda r: r["backward_mb"]) for rs in zip(*ranks, strict=True)]


def _sizes(spec: str) -> list[tuple[int, int, int]]:
    """``HxLxV,...`` -> [(hidden, layers, vocab), ...]."""
    try:
        return [tuple(int(x) for x in part.split("x")) for part in spec.split(",")]  # type: ignore[misc]
    except ValueError as exc:
        raise SystemExit(f"--sizes: expected HIDDENxLAYERSxVOCAB,... got {spec!r}") from exc


def memory_main(args: argparse.Namespace) -> None:
    """Measure the grid in fresh processes (one per model and configuration), fit the
    two-phase model on the fit sizes x fit token counts, print the table and one JSON line."""
    from relayrl.plan.memory import CALIBRATED, compare, fit

    work = Path(args.work or tempfile.mkdtemp(prefix="relayrl-mem-"))
    sizes = _sizes(args.sizes)
    fit_sizes = {sizes[int(i)] for i in args.fit_sizes.split(",")}
    fit_tokens = {int(t) for t in args.fit_tokens.split(",")}
    rows: list[dict] = []
    if args.rows_file and Path(args.rows_file).is_file():
        rows = [json.loads(x) for x in Path(args.rows_file).read_text().splitlines() if x]
    share = args.response / (args.prompt + args.response)
    done = {
        (r["hidden"], r["layers"], r["vocab"], r["config"], round(r["response_share"], 4))
        for r in rows
    }
    for h, layers, vocab in sizes:
        model = None
        for name in args.memory_configs.split(","):
            if (h, layers, vocab, name, round(share, 4)) in done:
                continue
            if model is None:
                model, _ = build_model(work / f"m{h}x{layers}x{vocab}", h, layers, vocab)
            toks = args.tokens if not name.endswith("_foreach") else args.tokens.split(",")[0]
            cmd = [sys.executable, __file__, "--phase-child", name, "--model", str(model)]
            cmd += ["--tokens", toks, "--threads", str(args.threads)]
            cmd += ["--prompt", str(args.prompt), "--response", str(args.response)]
            t0 = time.perf_counter()
            res = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            got = json.loads(res.strip().splitlines()[-1])
            for g in got:
                g.update(hidden=h, layers=layers, vocab=vocab)
            rows += got
            dt = time.perf_counter() - t0
            print(f"# {h}x{layers}x{vocab} {name}: {dt:.1f} s", file=sys.stderr, flush=True)
            if args.rows_file:
                with open(args.rows_file, "a") as f:
                    f.writelines(json.dumps(g) + "\n" for g in got)

    def in_fit(r: dict) -> bool:
        size = (r["hidden"], r["layers"], r["vocab"])
        same_share = abs(r["response_share"] - share) < 1e-4
        return size in fit_sizes and r["tokens"] in fit_tokens and same_share

    from relayrl.plan.memory import bench_shape

    train = [r for r in rows if in_fit(r) and r["config"] not in args.holdout_configs.split(",")]
    model_fit = fit(
        (bench_shape(r), r["backward_mb"] * 2**20, r["optimizer_mb"] * 2**20) for r in train
    )
    table = compare(model_fit, rows)
    for t, r in zip(table, rows, strict=True):
        t["in_fit"] = in_fit(r) and r["config"] not in args.holdout_configs.split(",")
    cal = compare(CALIBRATED, rows)
    for t, c in zip(table, cal, strict=True):
        t["calibrated_error"] = c["error"]
    out_errors = [abs(t["error"]) for t in table if not t["in_fit"]]
    print(
        f"{'config':>13} {'h':>4} {'L':>2} {'V':>6} {'T':>5} {'fit':>3} "
        f"{'bwd MB':>8} {'pred':>8} {'opt MB':>8} {'pred':>8} {'peak err':>8}"
    )
    for t in table:
        print(
            f"{t['config']:>13} {t['hidden']:>4} {t['layers']:>2} {t['vocab']:>6} "
            f"{t['tokens']:>5} {'y' if t['in_fit'] else 'n':>3} {t['backward_mb']:>8.1f} "
            f"{t['backward_pred_mb']:>8.1f} {t['optimizer_mb']:>8.1f} "
            f"{t['optimizer_pred_mb']:>8.1f} {t['error']:>+8.1%}"
        )
    print(
        json.dumps(
            {
                "fitted": {k: round(v, 4) for k, v in model_fit.to_dict().items()},
                "max_abs_error_out_of_sample": max(out_errors, default=0.0),
                "max_abs_error_in_fit": max(
                    (abs(t["error"]) for t in table if t["in_fit"]), default=0.0
                ),
                "rows": table,
            }
        )
    )


def planner_uncalibrated_mb(params: int, hidden: int, layers: int, tokens: int, dp: int) -> float:
    """The planner's first guess (``Planner.memory`` in relayrl.plan.search, tp = pp = 1):
    persistent ``4N + 12N/dp`` plus ``tokens * hidden * (2 layers + 34)`` activations."""
    return (4 * params + 12 * params / dp + tokens * hidden * (2 * layers + 34)) / 2**20


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
    p.add_argument("--configs", default="fp32,bf16,fp32_ckpt,lora,fsdp2_x2")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--memory", action="store_true", help="the two-phase memory grid and fit")
    p.add_argument("--sizes", default="256x2x4096,256x6x16384,512x4x8192,512x8x32000")
    p.add_argument("--fit-sizes", default="0,1,2", help="indices into --sizes used in the fit")
    p.add_argument("--tokens", default="128,256,512,1024", help="micro-batch tokens (--memory)")
    p.add_argument("--fit-tokens", default="256,1024")
    p.add_argument("--memory-configs", default="fp32,bf16,fp32_ckpt,lora,fp32_foreach,bf16_ckpt")
    p.add_argument("--holdout-configs", default="fp32_foreach,bf16_ckpt,fsdp2_x2")
    p.add_argument("--rows-file", default=None, help="append measured rows here; reuse them")
    p.add_argument("--phase-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase_child:
        args.config = args.phase_child
        args.tokens_list = [int(t) for t in args.tokens.split(",")]
        fsdp = args.config.startswith("fsdp")
        print(json.dumps(measure_phases_fsdp(args) if fsdp else measure_phases(args)))
        return
    if args.memory:
        memory_main(args)
        return
    if args.config:  # a child: one configuration, its figures as JSON on stdout
        res = run_fsdp(args) if args.config == "fsdp2_x2" else run_one(args)
        print(json.dumps(res))
        return
    from relayrl.plan.memory import BENCH_FLAGS, CALIBRATED, MB, TrainShape

    work = Path(args.work or tempfile.mkdtemp(prefix="relayrl-scale-"))
    model, params = build_model(work / "model", args.hidden, args.layers)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
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
        shape = TrainShape(
            params=float(params),
            trainable=res["trainable_params"],
            hidden=args.hidden,
            layers=args.layers,
            vocab=vocab,
            tokens=tokens,
            response_share=args.response / (args.prompt + args.response),
            **BENCH_FLAGS[name],
        )  # the RSS above the loaded weights: the model's peak less its W
        res["planner_mb"] = (CALIBRATED.peak_bytes(shape) - CALIBRATED.terms(shape)["W"]) / MB
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
