"""The one prepared GPU run: every GPU path of relayrl, each step pass/fail with its figures.

    tools/device_run.sh [--out DIR]                 # on the lent GPU (installs the kit first)
    PYTHONPATH=src python tools/device_run.py --device cpu --out /tmp/dr   # the same, tiny, CPU

Each step runs in turn (a failing step records its error and the next one runs); the JSON
(``device_run.json`` in ``--out``) is rewritten after every step, so a run cut short still
leaves what it measured. Steps:

- ``env``: device, GPU name, torch / CUDA / transformers versions.
- ``peaks``: an ``n^3`` bf16 matmul (FLOP/s = 2 n^3 / s) and a device-to-device copy
  (bandwidth = 2 x bytes / s, read + write): the ceilings the figures below are set against.
- ``engine``: bf16 with fp32 master weights on the device; the own engine generating there
  (KV cache, sampler on the device) with the synchronising device -> host transfers counted
  per forward (``torch.cuda.set_sync_debug_mode``); behaviour vs trainer logprobs; a GRPO
  update; the in-process weight load (s/GB).
- ``hot_path`` (``device_hot_path.py``): host reads of floating device values during one
  actor update of 2 mini-batches x 2 micro-batches (== 1: the metrics; the synchronising calls
  ``set_sync_debug_mode`` reports, with their sites), the optimizer's settings; a colocated
  engine's weight update with no copy off the device and weights equal to the actor's.
- ``ipc``: an engine in a spawned process on the same device, its weights shared through CUDA
  IPC (``cluster.engine_process``): greedy tokens equal to an in-process engine's with the
  same weights, before and after a weight update; the update's s/GB.
- ``fsdp``: FSDP2 world 1 over ``cpu:gloo,cuda:nccl``; sharded checkpoint save and resume
  (one update after resume equals one update without the round trip, bit for bit, under
  deterministic algorithms); activation checkpointing (same update, less memory); LoRA with
  the adapter-disabled reference (equal to the base model's logprobs; unchanged by updates).
- ``nccl_pair``: the NCCL weight group (``cluster.weight_collective``) between two processes
  on one GPU; NCCL refuses two ranks of a communicator on one device, and the step says so.
- ``update_<size>``: actor update tokens/s and MFU = 6 N tokens/s / matmul peak on Qwen2-shaped
  random-init models (~0.5B, ~1.5B), with and without activation checkpointing; the peak GPU
  memory of the update against ``plan.memory.CALIBRATED``'s prediction.
- ``decode``: own-engine decode tokens/s at 1, 32 and 256 rows as a fraction of the HBM
  roofline (weights + KV bytes read per step / measured bandwidth), beside HF ``generate``;
  weight load into the engine (s/GB).
- ``launch``: one kernel launch's cost, and an HF decode step (static KV cache) eager against
  its CUDA-graph replay at 1 and 32 rows: where a decode step's time goes.
- ``grpo``: ``relayrl demo`` with ``model.device=<device>``: SFT warm start, GRPO on
  arithmetic, held-out greedy pass rate before and after (started first, in its own process:
  its SFT runs on the CPU while the figures are measured; its GRPO may overlap the last of
  them, and the JSON records when it ran).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from device_common import (
    GB,
    RESULTS,
    ROOT,
    Run,
    _free_port,
    _r,
    _timed,
    random_batch,
    run_config,
    small_llama,
)
from device_figures import GRAPH_STATS, step_decode, step_launch, step_update
from device_hot_path import step_hot_path


def step_env(run: Run) -> dict[str, Any]:
    import transformers

    cuda = run.device.type == "cuda"
    if run.args.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
    out = {
        "device": run.device.type,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "gpu_mem_gib": _r(torch.cuda.get_device_properties(0).total_memory / 2**30)
        if cuda
        else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    RESULTS["device"] = {k: out[k] for k in ("device", "gpu", "torch", "cuda", "transformers")}
    import relayrl  # noqa: F401 - the package imports under this image
    from relayrl.config import RunConfig  # noqa: F401 - pydantic from the kit

    return out


def step_peaks(run: Run) -> dict[str, Any]:
    dev = run.device
    n = 8192 if dev.type == "cuda" else 256
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=dev, dtype=dt)
    b = torch.randn(n, n, device=dev, dtype=dt)
    for _ in range(3):
        a @ b
    s = _timed(lambda: torch.mm(a, b), dev, reps=10)
    flops = 2 * n**3 / s
    a = b = torch.empty(0)  # free the operands before the copy buffers
    nbytes = (4 << 30) if dev.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    s = _timed(lambda: dst.copy_(src), dev, reps=10)
    bw = 2 * nbytes / s
    RESULTS["peaks"] = {"matmul_flops": flops, "copy_bytes_per_s": bw}
    return {
        "matmul_n": n,
        "matmul_tflops": _r(flops / 1e12),
        "copy_gib": nbytes >> 30,
        "copy_tb_per_s": _r(bw / 1e12),
    }


def _count_syncs(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn`` counting the synchronising CUDA calls (device -> host waits) it makes."""
    if not torch.cuda.is_available():
        return fn(), -1
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    n = sum(1 for w in caught if "synchroniz" in str(w.message))
    return out, n


def step_engine(run: Run) -> dict[str, Any]:
    from relayrl.algos import compute_grpo
    from relayrl.model import load_tokenizer
    from relayrl.rollout import GenerationRequest, RolloutEngine
    from relayrl.rollout.types import SamplingParams
    from relayrl.workers import Experience
    from relayrl.workers.build import build_actor, engine_model

    path = small_llama(run)
    cfg = run_config(path, run.device, "model.dtype=bfloat16", "optim.lr=1e-4")
    tok = load_tokenizer(path)
    actor = build_actor(cfg, str(path))
    master = {str(p.dtype) for p in actor.model.parameters()}
    where = {str(p.device.type) for p in actor.model.parameters()}
    gen = engine_model(cfg.model, actor, str(path))
    engine = RolloutEngine(
        gen, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=64
    )
    g = torch.Generator().manual_seed(1)
    reqs = [
        GenerationRequest(
            torch.randint(4, len(tok), (16,), generator=g).tolist(),
            SamplingParams(max_tokens=48, ignore_eos=True),
            group_id=i // 4,
        )
        for i in range(32)
    ]
    # warm-up: the same requests, so every decode graph these steps need is captured here
    # (a capture synchronises the device; the counted run must only replay)
    engine.generate(reqs)
    f0 = engine.stats()["forwards"]
    samples, syncs = _count_syncs(lambda: engine.generate(reqs))
    forwards = engine.stats()["forwards"] - f0
    exp = Experience.from_samples(samples, tok.pad_token_id)
    mask = exp.response_mask
    rewards = torch.zeros_like(mask)
    last = (mask.sum(1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(exp)), last] = torch.rand(len(exp), generator=g)
    exp.advantages, _ = compute_grpo(rewards, mask, exp.group_index)
    exp.old_logprobs = actor.compute_logprobs(exp)
    d = (exp.old_logprobs - exp.behaviour_logprobs).abs() * mask
    mean_diff, max_diff = float(d.sum() / mask.sum()), float(d.max())
    stats = actor.update(exp)
    finite = all(v == v and abs(v) != float("inf") for v in stats.values())
    state = actor.state_dict()
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    sync_s = _timed(lambda: engine.update_weights(state, version=1), run.device)
    cuda = run.device.type == "cuda"
    engine_stats = engine.stats()
    per_fwd = syncs / max(forwards, 1) if syncs >= 0 else None
    ok = (
        master == {"torch.float32"}
        and where == {run.device.type}
        and str(engine.device).startswith(run.device.type)
        and mean_diff <= 0.02
        and finite
        and (not cuda or (per_fwd is not None and per_fwd <= 1.0 + 1e-9))
    )
    return {
        "ok": ok,
        "master_dtypes": sorted(master),
        "engine_dtype": str(next(gen.parameters()).dtype),
        "engine_device": str(engine.device),
        "forwards": forwards,
        "host_syncs": syncs,
        "host_syncs_per_forward": _r(per_fwd) if per_fwd is not None else None,
        "logprob_abs_diff_mean": _r(mean_diff),
        "logprob_abs_diff_max": _r(max_diff),
        "update_stats_finite": finite,
        "weight_load_s_per_gb": _r(sync_s / (nbytes / GB)),
        "weights_gb": _r(nbytes / GB),
        "graph_stats": {k: engine_stats.get(k) for k in GRAPH_STATS},
    }


def step_ipc(run: Run) -> dict[str, Any]:
    from relayrl.cluster.engine_process import EngineProcess, EngineSpec
    from relayrl.model import load_causal_lm, load_tokenizer
    from relayrl.rollout import GenerationRequest, RolloutEngine
    from relayrl.rollout.types import SamplingParams

    path = small_llama(run)
    tok = load_tokenizer(path)
    dtype = torch.bfloat16 if run.device.type == "cuda" else torch.float32
    model = load_causal_lm(str(path), dtype).to(run.device).eval().requires_grad_(False)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dev = f"cuda:{torch.cuda.current_device()}" if run.device.type == "cuda" else "cpu"
    spec = EngineSpec(
        model_path=str(path),
        dtype=str(dtype).removeprefix("torch."),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=16,
        threads=1,
        version=0,
        urgent_steps=4,
        device=dev,
    )
    g = torch.Generator().manual_seed(2)
    reqs = [
        GenerationRequest(
            torch.randint(4, len(tok), (12,), generator=g).tolist(),
            SamplingParams(max_tokens=24, greedy=True, ignore_eos=True),
        )
        for _ in range(8)
    ]
    local = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=16
    )
    with EngineProcess(spec, state) as proc:
        shared_dev = {str(t.device) for t in proc._shared.values()}
        a = [s.response_ids for s in proc.generate(reqs)]
        b = [s.response_ids for s in local.generate(reqs)]
        same0 = a == b
        with torch.no_grad():
            new = {
                k: v + 0.02 * torch.randn_like(v) if v.is_floating_point() else v
                for k, v in state.items()
            }
            model.load_state_dict(new)
        nbytes = sum(v.numel() * v.element_size() for v in new.values())
        t0 = time.perf_counter()
        proc.update_weights(new, version=1)
        proc.wait_weights_loaded()
        upd_s = time.perf_counter() - t0
        out1 = proc.generate(reqs)
        c = [s.response_ids for s in out1]
        d = [s.response_ids for s in local.generate(reqs)]
        same1 = c == d
        changed = c != a
        versions = sorted({v for s in out1 for v in s.versions})
        worker = proc.pid
    return {
        "ok": same0 and same1 and changed and (run.device.type != "cuda" or shared_dev == {dev}),
        "shared_weights_device": sorted(shared_dev),
        "worker_pid": worker,
        "parent_pid": os.getpid(),
        "greedy_equal_before_update": same0,
        "greedy_equal_after_update": same1,
        "update_changed_output": changed,
        "versions_after_update": versions,
        "update_s_per_gb": _r(upd_s / (nbytes / GB)),
        "weights_gb": _r(nbytes / GB),
    }


def _init_world1(device: torch.device) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(0)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)


def _params(actor: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in actor.state_dict().items()}


def step_fsdp(run: Run) -> dict[str, Any]:
    import torch.distributed as dist

    from relayrl.model import model_vocab_size
    from relayrl.workers.build import build_actor, build_reference

    path = small_llama(run)
    vocab = model_vocab_size(path) or 64
    exp = random_batch(vocab, 8, 16, 32)
    exp2 = random_batch(vocab, 8, 16, 32, seed=1)
    out: dict[str, Any] = {}
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _init_world1(run.device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    math_attention = sdpa_kernel(SDPBackend.MATH)  # deterministic backward
    math_attention.__enter__()
    try:
        out["backend"] = str(dist.get_backend())
        cfg = run_config(
            path, run.device, "model.dtype=bfloat16", "model.fsdp.enabled=true", "optim.lr=1e-3"
        )
        a = build_actor(cfg, str(path))
        out["actor_parallelism"] = type(a.parallelism).__name__
        out["sharded"] = bool(getattr(a, "sharded", False))
        a.update(exp)
        ckpt = run.work / "sharded"
        a.save_sharded(str(ckpt))
        a.update(exp2)
        direct = _params(a)
        b = build_actor(cfg, str(path))
        b.load_sharded(str(ckpt))
        b.update(exp2)
        resumed = _params(b)
        c = build_actor(cfg, str(path))  # control: determinism of one update from the same state
        c.load_sharded(str(ckpt))
        c.update(exp2)
        control = _params(c)
        out["resume_bit_exact"] = all(torch.equal(direct[k], resumed[k]) for k in direct)
        out["resume_max_abs_diff"] = max(
            float((direct[k] - resumed[k]).abs().max()) for k in direct
        )
        out["control_bit_exact"] = all(torch.equal(control[k], resumed[k]) for k in direct)
        del a, b, c
    finally:
        math_attention.__exit__(None, None, None)
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()
    # activation checkpointing: the same update, less activation memory
    figs = {}
    for ac in (False, True):
        cfg = run_config(
            path,
            run.device,
            "model.dtype=bfloat16",
            "optim.lr=1e-3",
            f"model.gradient_checkpointing={str(ac).lower()}",
        )
        a = build_actor(cfg, str(path))
        if run.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        a.update(random_batch(vocab, 16, 64, 192))
        peak = torch.cuda.max_memory_allocated() if run.device.type == "cuda" else 0
        figs[ac] = (_params(a), peak)
        del a
    diff = max(float((figs[True][0][k] - figs[False][0][k]).abs().max()) for k in figs[True][0])
    out["ac_max_abs_param_diff"] = _r(diff)
    out["ac_peak_gib"] = _r(figs[True][1] / 2**30)
    out["no_ac_peak_gib"] = _r(figs[False][1] / 2**30)
    # LoRA: the reference is the actor with adapters off = the base model
    cfg = run_config(path, run.device, "model.dtype=bfloat16", "optim.lr=5e-2", "model.lora.r=8")
    lora = build_actor(cfg, str(path))
    ref = build_reference(cfg, lora)
    base = build_reference(run_config(path, run.device, "model.dtype=bfloat16"), None)
    ref0, base0 = ref.compute_logprobs(exp), base.compute_logprobs(exp)
    act0 = lora.compute_logprobs(exp)
    lora.update(exp)
    lora.update(exp2)
    ref1, act1 = ref.compute_logprobs(exp), lora.compute_logprobs(exp)
    m = exp.response_mask.bool()
    out["lora_reference_adapters_off"] = bool(ref.adapters_off and ref.model is lora.model)
    # B = 0 at the start: adapters on or off, the same function of the same weights
    out["lora_ref_vs_actor_at_init_max_abs"] = _r(float((ref0 - act0)[m].abs().max()))
    # the base model's own bf16 weights vs fp32 master weights under bf16 autocast
    out["lora_ref_vs_base_max_abs"] = _r(float((ref0 - base0)[m].abs().max()))
    out["lora_actor_moved_mean_abs"] = _r(float((act1 - act0)[m].abs().mean()))
    out["lora_ref_unchanged"] = bool(torch.equal(ref0, ref1))
    out["ok"] = (
        out["sharded"]
        and out["resume_bit_exact"]
        and diff <= 5e-3
        and (run.device.type != "cuda" or figs[True][1] < figs[False][1])
        and out["lora_ref_vs_actor_at_init_max_abs"] <= 1e-6
        and out["lora_ref_vs_base_max_abs"] <= 0.05
        and out["lora_ref_unchanged"]
        and out["lora_actor_moved_mean_abs"] > 0
    )
    return out


def _nccl_rank(rank: int, port: int, backend: str, numel: int, out: str) -> None:
    try:
        _nccl_rank_body(rank, port, backend, numel, out)
    except Exception as e:  # noqa: BLE001 - the reason goes into the JSON
        Path(f"{out}.{rank}").write_text(json.dumps({"error": f"{type(e).__name__}: {e}"[:1500]}))
        raise


def _nccl_rank_body(rank: int, port: int, backend: str, numel: int, out: str) -> None:
    from relayrl.cluster.weight_collective import WeightGroup, entries_of, plan_buckets

    if backend == "nccl":
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    group = WeightGroup("127.0.0.1", port, rank, 2, backend, timeout_s=60)
    state = {
        f"w{i}": torch.full((numel,), float(i), device=dev, dtype=torch.bfloat16) for i in range(8)
    }
    buckets = plan_buckets(entries_of(state), 256 << 20)
    times = []
    for version in range(3):
        torch.cuda.synchronize() if backend == "nccl" else None
        t0 = time.perf_counter()
        if rank == 0:
            group.send(version, buckets, state.items())
        else:
            _, _, parts = group.receive()
            got = {}
            for p in parts:
                got.update({k: v.clone() for k, v in p.items()})
        torch.cuda.synchronize() if backend == "nccl" else None
        times.append(time.perf_counter() - t0)
    res = {"seconds": times}
    if rank == 1:
        res["correct"] = all(torch.equal(got[k], state[k]) for k in state)
    group.close()
    Path(f"{out}.{rank}").write_text(json.dumps(res))


def step_nccl_pair(run: Run) -> dict[str, Any]:
    import torch.multiprocessing as mp

    backend = "nccl" if run.device.type == "cuda" else "gloo"
    numel = (64 << 20) if run.device.type == "cuda" else (1 << 16)  # 8 x 128 MiB bf16
    out = str(run.work / "nccl_pair")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_nccl_rank, args=(r, port, backend, numel, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    deadline = time.time() + 120
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.time()))
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    res = [
        json.loads(Path(f"{out}.{r}").read_text()) if Path(f"{out}.{r}").is_file() else None
        for r in (0, 1)
    ]
    nbytes = 8 * numel * 2
    errors = [r.get("error") for r in res if r and r.get("error")]
    if res[0] and res[1] and not errors:
        best = min(
            max(a, b) for a, b in zip(res[0]["seconds"][1:], res[1]["seconds"][1:], strict=True)
        )
        return {
            "ok": bool(res[1]["correct"]),
            "backend": backend,
            "gb": _r(nbytes / GB),
            "s_per_gb": _r(best / (nbytes / GB)),
            "exitcodes": codes,
        }
    one_gpu = any("Duplicate GPU" in e for e in errors)
    return {
        "ok": False,
        "backend": backend,
        "exitcodes": codes,
        "hung": alive,
        "errors": errors,
        "cannot_run_on_one_gpu": one_gpu,
        "note": "see the ranks' stderr above (NCCL refuses two ranks of one communicator "
        "on one device: 'Duplicate GPU detected')",
    }


def start_grpo(run: Run) -> subprocess.Popen[bytes] | None:
    if run.args.only and "grpo" not in run.args.only.split(","):
        return None
    log = open(run.out / "grpo.log", "wb")  # noqa: SIM115 - closed with the process
    cmd = [
        sys.executable,
        "-m",
        "relayrl.cli",
        "demo",
        "--run-dir",
        str(run.work / "demo"),
        f"model.device={run.device.type}",
        "train.eval_every=50",
        *run.args.grpo_overrides,
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
    )
    RESULTS["grpo_cmd"] = " ".join(cmd[1:])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def step_grpo(
    proc: subprocess.Popen[bytes] | None, t_start: float, budget_s: float
) -> Callable[[Run], dict[str, Any]]:
    def fn(run: Run) -> dict[str, Any]:
        if proc is None:
            raise RuntimeError("not started")
        try:
            proc.wait(timeout=max(1.0, budget_s - (time.time() - t_start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        text = (run.out / "grpo.log").read_text(errors="replace")
        tail = "\n".join(ln for ln in text.splitlines() if ln.isascii())[-800:]
        import re

        m = re.search(r"after SFT ([\d.]+)%\s+->\s+after GRPO ([\d.]+)%", text)
        t = re.search(r"time: SFT (\d+) s, GRPO (\d+) s", text)
        out: dict[str, Any] = {"returncode": proc.returncode, "log_tail": tail}
        if t:
            out["sft_s"], out["grpo_s"] = int(t.group(1)), int(t.group(2))
            out["grpo_started_s"] = round(t_start - run.t0 + int(t.group(1)), 1)
        evals = []
        metrics = run.work / "demo" / "grpo" / "metrics.jsonl"
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                row = json.loads(line)
                if "eval/pass_rate" in row:
                    evals.append((row.get("step"), row["eval/pass_rate"]))
        out["evals"] = evals
        if not m:
            # cut at the budget: the evaluations so far (first: after SFT)
            out["ok"] = len(evals) >= 2 and evals[-1][1] > evals[0][1]
            out["cut_at_budget"] = True
            return out
        before, after = float(m.group(1)) / 100, float(m.group(2)) / 100
        out.update(before=before, after=after, ok=proc.returncode == 0 and after > before)
        return out

    return fn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=os.environ.get("OUT", "device_out"))
    p.add_argument("--only", default="", help="comma-separated step names")
    p.add_argument("--grpo-budget-s", type=float, default=330.0)
    p.add_argument("--grpo-overrides", nargs="*", default=[])
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"device_run: --device cuda but CUDA is not available (torch {torch.__version__})",
            file=sys.stderr,
        )
        return 2
    run = Run(args)
    t_grpo = time.time()
    proc = start_grpo(run)
    run.step("env", step_env)
    run.step("peaks", step_peaks)
    run.step("engine", step_engine)
    run.step("hot_path", step_hot_path)
    run.step("ipc", step_ipc)
    run.step("fsdp", step_fsdp)
    run.step("nccl_pair", step_nccl_pair)
    run.step("update_0.5b", step_update("0.5b"))
    run.step("update_1.5b", step_update("1.5b"))
    run.step("decode", step_decode)
    run.step("launch", step_launch)
    run.step("grpo", step_grpo(proc, t_grpo, args.grpo_budget_s))
    run.save()
    print(json.dumps({k: RESULTS[k] for k in ("passed", "failed", "wall_s")}))
    return 0 if not RESULTS["failed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
