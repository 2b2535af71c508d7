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
- ``grpo``: ``relayrl demo`` with ``model.device=<device>``: SFT warm start, GRPO on
  arithmetic, held-out greedy pass rate before and after (started first, in its own process:
  its SFT runs on the CPU while the figures are measured; its GRPO may overlap the last of
  them, and the JSON records when it ran).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
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
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
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


def random_batch(vocab: int, rows: int, prompt: int, response: int, seed: int = 0) -> Any:
    from relayrl.model import pack_batch
    from relayrl.workers import Experience

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)]
    resps = [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(rows)]
    exp = Experience(pack_batch(prompts, resps, 0))
    exp["advantages"] = torch.randn(rows, 1, generator=g).expand(-1, response).clone()
    return exp


# --------------------------------------------------------------------------- steps
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
    return {"matmul_n": n, "matmul_tflops": _r(flops / 1e12), "copy_gib": nbytes >> 30,
            "copy_tb_per_s": _r(bw / 1e12)}


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
    gen = engine_model(cfg, actor, str(path))
    engine = RolloutEngine(gen, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                           max_slots=64)
    g = torch.Generator().manual_seed(1)
    reqs = [
        GenerationRequest(torch.randint(4, len(tok), (16,), generator=g).tolist(),
                          SamplingParams(max_tokens=48, ignore_eos=True), group_id=i // 4)
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
    exp["advantages"], _ = compute_grpo(rewards, mask, exp["group_index"])
    exp["old_logprobs"] = actor.compute_logprobs(exp)
    d = (exp["old_logprobs"] - exp["behaviour_logprobs"]).abs() * mask
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
    spec = EngineSpec(model_path=str(path), dtype=str(dtype).removeprefix("torch."),
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      max_slots=16, threads=1, version=0, urgent_steps=4, device=dev)
    g = torch.Generator().manual_seed(2)
    reqs = [
        GenerationRequest(torch.randint(4, len(tok), (12,), generator=g).tolist(),
                          SamplingParams(max_tokens=24, greedy=True, ignore_eos=True))
        for _ in range(8)
    ]
    local = RolloutEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                          max_slots=16)
    with EngineProcess(spec, state) as proc:
        shared_dev = {str(t.device) for t in proc._shared.values()}
        a = [s.response_ids for s in proc.generate(reqs)]
        b = [s.response_ids for s in local.generate(reqs)]
        same0 = a == b
        with torch.no_grad():
            new = {k: v + 0.02 * torch.randn_like(v) if v.is_floating_point() else v
                   for k, v in state.items()}
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
        "ok": same0 and same1 and changed and (run.device.type != "cuda" or
                                               shared_dev == {dev}),
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
        cfg = run_config(path, run.device, "model.dtype=bfloat16", "model.fsdp.enabled=true",
                         "optim.lr=1e-3")
        a = build_actor(cfg, str(path))
        out["actor_class"] = type(a).__name__
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
        out["resume_max_abs_diff"] = max(float((direct[k] - resumed[k]).abs().max())
                                         for k in direct)
        out["control_bit_exact"] = all(torch.equal(control[k], resumed[k]) for k in direct)
        del a, b, c
    finally:
        math_attention.__exit__(None, None, None)
        torch.use_deterministic_algorithms(False)
        dist.destroy_process_group()
    # activation checkpointing: the same update, less activation memory
    figs = {}
    for ac in (False, True):
        cfg = run_config(path, run.device, "model.dtype=bfloat16", "optim.lr=1e-3",
                         f"model.gradient_checkpointing={str(ac).lower()}")
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
    cfg = run_config(path, run.device, "model.dtype=bfloat16", "optim.lr=5e-2",
                     "model.lora.r=8")
    lora = build_actor(cfg, str(path))
    ref = build_reference(cfg, lora)
    base = build_reference(run_config(path, run.device, "model.dtype=bfloat16"), None)
    ref0, base0 = ref.compute_logprobs(exp), base.compute_logprobs(exp)
    act0 = lora.compute_logprobs(exp)
    lora.update(exp)
    lora.update(exp2)
    ref1, act1 = ref.compute_logprobs(exp), lora.compute_logprobs(exp)
    m = exp.response_mask.bool()
    out["lora_reference_class"] = type(ref).__name__
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
    state = {f"w{i}": torch.full((numel,), float(i), device=dev, dtype=torch.bfloat16)
             for i in range(8)}
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
    res = [json.loads(Path(f"{out}.{r}").read_text()) if Path(f"{out}.{r}").is_file() else None
           for r in (0, 1)]
    nbytes = 8 * numel * 2
    errors = [r.get("error") for r in res if r and r.get("error")]
    if res[0] and res[1] and not errors:
        best = min(max(a, b) for a, b in zip(res[0]["seconds"][1:], res[1]["seconds"][1:],
                                              strict=True))
        return {"ok": bool(res[1]["correct"]), "backend": backend, "gb": _r(nbytes / GB),
                "s_per_gb": _r(best / (nbytes / GB)), "exitcodes": codes}
    one_gpu = any("Duplicate GPU" in e for e in errors)
    return {"ok": False, "backend": backend, "exitcodes": codes, "hung": alive, "errors": errors,
            "cannot_run_on_one_gpu": one_gpu,
            "note": "see the ranks' stderr above (NCCL refuses two ranks of one communicator "
                    "on one device: 'Duplicate GPU detected')"}


def _update_figures(run: Run, size: str, ac: bool, rows: int, prompt: int, response: int,
                    micro: int, steps: int) -> dict[str, Any]:
    from relayrl.model.device import apply_precision, enable_gradient_checkpointing, precision_for
    from relayrl.plan.memory import CALIBRATED, TrainShape
    from relayrl.workers.actor import ActorWorker

    path = qwen2_dir(run, size)
    cfg = run_config(path, run.device, "model.dtype=bfloat16",
                     f"model.gradient_checkpointing={str(ac).lower()}",
                     f"algo.micro_batch_size={micro}")
    precision = precision_for(cfg.model, trainable=True)
    model = qwen2_model(path, precision.param_dtype, run.device)
    if ac:
        enable_gradient_checkpointing(model)
    model = apply_precision(model, precision, run.device)
    actor = ActorWorker.from_config(model, cfg)
    n = sum(p.numel() for p in model.parameters())
    c = model.config
    exp = random_batch(c.vocab_size, rows, prompt, response)
    actor.update(exp)  # warm-up: allocator, Adam state
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    s = _timed(lambda: actor.update(exp), run.device, reps=steps)
    peak = torch.cuda.max_memory_allocated() if run.device.type == "cuda" else 0
    tokens = rows * (prompt + response)
    tps = tokens / s
    flops = RESULTS.get("peaks", {}).get("matmul_flops")
    shape = TrainShape(params=n, trainable=n, hidden=c.hidden_size, layers=c.num_hidden_layers,
                       vocab=c.vocab_size, tokens=micro * (prompt + response),
                       response_share=response / (prompt + response), bf16=True,
                       checkpointing=ac, optimizer="foreach")
    pred = CALIBRATED.peak_bytes(shape)
    return {
        "params": n,
        "tokens_per_step": tokens,
        "micro_batch_rows": micro,
        "step_s": _r(s),
        "tokens_per_s": _r(tps),
        "mfu": _r(6 * n * tps / flops) if flops else None,
        "peak_gib": _r(peak / 2**30),
        "predicted_peak_gib": _r(pred / 2**30),
        "prediction_error": _r(pred / peak - 1) if peak else None,
    }


def step_update(size: str) -> Callable[[Run], dict[str, Any]]:
    def fn(run: Run) -> dict[str, Any]:
        cuda = run.device.type == "cuda"
        if not cuda:
            size_ = "tiny"
            kw = dict(rows=4, prompt=16, response=16, micro=2, steps=1)
        else:
            size_ = size
            kw = dict(rows=16, prompt=256, response=768, micro=8, steps=3)
        out: dict[str, Any] = {"config": size_}
        for ac in (False, True):
            figs = _update_figures(run, size_, ac, **kw)
            out["ac" if ac else "no_ac"] = figs
        out["ok"] = all(out[k]["tokens_per_s"] > 0 for k in ("ac", "no_ac"))
        return out

    return fn


def _decode_engine(model: Any, slots: int, graphs: bool) -> Any:
    """An engine over ``model``; ``graphs``: decode steps as CUDA graphs (on the CPU: the
    same static-buffer step run eagerly, ``DecodeGraphs(capture=False)``)."""
    from relayrl.rollout import RolloutEngine
    from relayrl.rollout.cuda_graphs import DecodeGraphs

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    engine = RolloutEngine(model, eos_token_id=model.config.vocab_size + 7, pad_token_id=0,
                           max_slots=slots, cuda_graphs=graphs and cuda)
    if graphs and not cuda:
        engine.runner.graphs = DecodeGraphs(model, 0, slots, dev, capture=False)
    return engine


def _timed_generate(engine: Any, reqs: list[Any], device: torch.device
                    ) -> tuple[list[Any], float, float]:
    """(samples, wall seconds, decode seconds: decode-only steps and their sampling)."""
    st0 = engine.stats()
    _sync(device)
    t0 = time.perf_counter()
    samples = engine.generate(reqs)
    _sync(device)
    wall = time.perf_counter() - t0
    st1 = engine.stats()
    dec_s = (st1["decode_time_s"] + st1["sample_time_s"]) - (
        st0["decode_time_s"] + st0["sample_time_s"])
    return samples, wall, dec_s


def _compare(a: list[Any], b: list[Any]) -> dict[str, Any]:
    """Rows with the same tokens, and the largest logprob difference over those rows."""
    same = [(x, y) for x, y in zip(a, b, strict=True) if x.response_ids == y.response_ids]
    diffs = [abs(p - q) for x, y in same
             for p, q in zip(x.behaviour_logprobs, y.behaviour_logprobs, strict=True)]
    return {"rows_tokens_equal": len(same), "rows": len(a),
            "logprob_max_abs_diff": _r(max(diffs)) if diffs else None,
            "logprobs_bitwise_equal": len(same) == len(a) and not any(diffs)}


GRAPH_STATS = ("cuda_graph_mode", "cuda_graph_captures", "cuda_graph_capture_s",
               "cuda_graph_replays", "cuda_graph_eager_steps", "cuda_graph_invalidations",
               "cuda_graphs_held", "cuda_graph_disabled")


def step_decode(run: Run) -> dict[str, Any]:
    """Own-engine decode at 1/32/256 rows, CUDA graphs off (eager) and on, against the HBM
    roofline and HF ``generate``; graphs' tokens against eager's; a graph replay against the
    same static step run eagerly (bitwise: what capture must not change)."""
    from relayrl.rollout import GenerationRequest
    from relayrl.rollout.cuda_graphs import DecodeGraphs
    from relayrl.rollout.types import SamplingParams

    cuda = run.device.type == "cuda"
    size = "0.5b" if cuda else "tiny"
    path = qwen2_dir(run, size)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = qwen2_model(path, dtype, run.device).eval().requires_grad_(False)
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    wbytes = n * (2 if cuda else 4)
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * (2 if cuda else 4)
    bw = RESULTS.get("peaks", {}).get("copy_bytes_per_s")
    prompt, new = (64, 128) if cuda else (8, 8)
    rows_list = (1, 32, 256) if cuda else (1, 4)
    slots = max(rows_list)
    eager = _decode_engine(model, slots, graphs=False)
    graphed = _decode_engine(model, slots, graphs=True)
    g = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {"config": size, "params": n, "prompt": prompt, "new_tokens": new}
    warm = [GenerationRequest([5] * prompt, SamplingParams(max_tokens=4))]
    eager.generate(warm)
    graphed.generate(warm)
    for rows in rows_list:
        prompts = [torch.randint(3, c.vocab_size, (prompt,), generator=g).tolist()
                   for _ in range(rows)]
        reqs = [GenerationRequest(p, SamplingParams(max_tokens=new, ignore_eos=True, seed=i))
                for i, p in enumerate(prompts)]
        samples, wall, dec_s = _timed_generate(eager, reqs, run.device)
        gen = sum(len(s.response_ids) for s in samples)
        dec_tokens = gen - rows  # the first token of each row comes from its prefill
        dec_tps = dec_tokens / dec_s if dec_s > 0 else 0.0
        # one decode step reads the weights once and every row's KV (mean context)
        step_bytes = wbytes + rows * (prompt + new / 2) * kv_per_token
        roof_tps = rows * bw / step_bytes if bw else None
        # graphs: a first run captures what these shapes need, the second is timed
        t0 = time.perf_counter()
        graphed.generate(reqs)
        first_s = time.perf_counter() - t0
        g_samples, g_wall, g_dec_s = _timed_generate(graphed, reqs, run.device)
        g_tps = (sum(len(s.response_ids) for s in g_samples) - rows) / g_dec_s if g_dec_s else 0.0
        ids = torch.tensor(prompts, device=run.device)
        model.generation_config.pad_token_id = 0
        hf_kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0,
                     eos_token_id=None)
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=True, top_k=0, eos_token_id=None)
        _sync(run.device)
        t0 = time.perf_counter()
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), **hf_kw)
        _sync(run.device)
        hf_s = time.perf_counter() - t0
        hf_tokens = (hf.shape[1] - prompt) * rows
        out[f"rows_{rows}"] = {
            "engine_tokens_per_s": _r(gen / wall),
            "engine_decode_tokens_per_s": _r(dec_tps),
            "roofline_tokens_per_s": _r(roof_tps) if roof_tps else None,
            "roofline_fraction": _r(dec_tps / roof_tps) if roof_tps else None,
            "hf_generate_tokens_per_s": _r(hf_tokens / hf_s),
            "engine_over_hf": _r((gen / wall) / (hf_tokens / hf_s)),
            "graphs": {
                "engine_tokens_per_s": _r(sum(len(s.response_ids) for s in g_samples) / g_wall),
                "engine_decode_tokens_per_s": _r(g_tps),
                "decode_step_ms": _r(rows / g_tps * 1e3) if g_tps else None,
                "roofline_fraction": _r(g_tps / roof_tps) if roof_tps else None,
                "over_eager_decode": _r(g_tps / dec_tps) if dec_tps else None,
                "first_run_s": _r(first_s),
                "vs_eager": _compare(g_samples, samples),
            },
        }
    st = graphed.stats()
    out["graph_stats"] = {k: st.get(k) for k in GRAPH_STATS}
    # a graph replay against the same static step run eagerly (capture=False): the same
    # kernels on the same buffers, so the same bits (greedy and sampled rows)
    static = _decode_engine(model, slots, graphs=False)
    static.runner.graphs = DecodeGraphs(model, 0, slots, run.device, capture=False)
    check = [GenerationRequest(torch.randint(3, c.vocab_size, (prompt,), generator=g).tolist(),
                               SamplingParams(max_tokens=new // 4, ignore_eos=True, seed=i,
                                              temperature=0.0 if i % 2 else 1.0))
             for i in range(min(32, slots))]
    graphed_check = graphed.generate(check)
    out["graph_vs_static_eager"] = _compare(graphed_check, static.generate(check))
    out["graph_vs_static_eager"]["static_steps"] = static.stats()["cuda_graph_eager_steps"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    versions = iter(range(1, 10))
    held = graphed.stats()["cuda_graphs_held"]
    graphed.update_weights(state, version=next(versions))
    s = _timed(lambda: graphed.update_weights(state, version=next(versions)), run.device, reps=3)
    out["weight_load_s_per_gb"] = _r(s / (nbytes / GB))
    out["weights_gb"] = _r(nbytes / GB)
    st = graphed.stats()
    # weights copied in place: the graphs stay, and still give the same tokens
    out["graphs_kept_after_update"] = st["cuda_graphs_held"] == held and held > 0
    out["graphs_same_after_update"] = _compare(graphed.generate(check), graphed_check)[
        "logprobs_bitwise_equal"]
    out["ok"] = (
        all(out[f"rows_{r}"]["engine_tokens_per_s"] > 0 for r in rows_list)
        and all(out[f"rows_{r}"]["graphs"]["engine_tokens_per_s"] > 0 for r in rows_list)
        and st["cuda_graph_disabled"] is None
        and (st["cuda_graph_replays"] > 0 if cuda else st["cuda_graph_eager_steps"] > 0)
        and out["graph_vs_static_eager"]["logprobs_bitwise_equal"]
        and out["graphs_kept_after_update"]
        and out["graphs_same_after_update"]
    )
    return out


def _static_decode(model: Any, rows: int, prompt: int, steps: int, n: int, kv_per_token: int,
                   bw: float | None) -> dict[str, Any]:
    """One HF decode step (StaticCache) at ``rows``: eager ms, and CUDA-graph replay ms."""
    from transformers import StaticCache

    c = model.config
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    rec: dict[str, Any] = {}
    with torch.no_grad():
        cache = StaticCache(config=c, max_cache_len=prompt + 2 * steps + 8)
        ids = torch.randint(3, c.vocab_size, (rows, prompt), device=dev)
        model(input_ids=ids, past_key_values=cache, use_cache=True,
              cache_position=torch.arange(prompt, device=dev))
        tok = torch.randint(3, c.vocab_size, (rows, 1), device=dev)
        pos = torch.tensor([prompt], device=dev)

        def step() -> torch.Tensor:
            return model(input_ids=tok, past_key_values=cache, use_cache=True,
                         cache_position=pos).logits

        for _ in range(3):
            step()
            pos += 1
        eager = _timed(lambda: (step(), pos.add_(1)), dev, reps=steps)
        rec["eager_step_ms"] = _r(eager * 1e3)
        if cuda:
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                graph.replay()
                graphed = _timed(lambda: (graph.replay(), pos.add_(1)), dev, reps=steps)
                rec["graph_step_ms"] = _r(graphed * 1e3)
                rec["graph_speedup"] = _r(eager / graphed)
                ctx = prompt + steps
                ideal = (n * 2 + rows * ctx * kv_per_token) / bw if bw else None
                rec["graph_roofline_fraction"] = _r(ideal / graphed) if ideal else None
            except Exception as e:  # noqa: BLE001 - reported, the eager figure stands
                rec["graph_error"] = f"{type(e).__name__}: {e}"[:800]
    return rec


def step_launch(run: Run) -> dict[str, Any]:
    """Where a decode step's time goes: per-kernel launch cost, and one HF decode step
    (StaticCache) eager against its CUDA-graph replay, at 1 and 32 rows."""
    dev = run.device
    cuda = dev.type == "cuda"
    x = torch.zeros(16, device=dev)
    for _ in range(100):
        x.add_(1)
    launch_s = _timed(lambda: x.add_(1), dev, reps=2000)
    size = "0.5b" if cuda else "tiny"
    path = qwen2_dir(run, size)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = qwen2_model(path, dtype, dev).eval().requires_grad_(False)
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * (2 if cuda else 4)
    bw = RESULTS.get("peaks", {}).get("copy_bytes_per_s")
    out: dict[str, Any] = {"launch_us": _r(launch_s * 1e6), "config": size}
    prompt, steps = 64, 32
    for rows in (1, 32):
        out[f"rows_{rows}"] = _static_decode(model, rows, prompt, steps, n, kv_per_token, bw)
    out["ok"] = not cuda or all("graph_step_ms" in out[f"rows_{r}"] for r in (1, 32))
    return out


# --------------------------------------------------------------------------- GRPO demo
def start_grpo(run: Run) -> subprocess.Popen[bytes] | None:
    if run.args.only and "grpo" not in run.args.only.split(","):
        return None
    log = open(run.out / "grpo.log", "wb")  # noqa: SIM115 - closed with the process
    cmd = [sys.executable, "-m", "relayrl.cli", "demo", "--run-dir", str(run.work / "demo"),
           f"model.device={run.device.type}", "train.eval_every=50", *run.args.grpo_overrides]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                                   os.environ.get("PYTHONPATH")])))
    RESULTS["grpo_cmd"] = " ".join(cmd[1:])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def step_grpo(proc: subprocess.Popen[bytes] | None, t_start: float, budget_s: float
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
        print(f"device_run: --device cuda but CUDA is not available (torch {torch.__version__})",
              file=sys.stderr)
        return 2
    run = Run(args)
    t_grpo = time.time()
    proc = start_grpo(run)
    run.step("env", step_env)
    run.step("peaks", step_peaks)
    run.step("engine", step_engine)
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
