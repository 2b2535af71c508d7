"""Peak memory of a GRPO step of SmolLM2-135M-Instruct (49,152-token vocabulary), full
fine-tuning and LoRA, measured against the planner's prediction (``relayrl.plan.memory``).

Each variant runs in a fresh child process built from its recipe
(``configs/grpo_smollm2_arithmetic_full.yaml``, ``configs/grpo_smollm2_arithmetic.yaml``: the
actor exactly as ``relayrl train`` builds it, its ``algo`` mini-batching and its AdamW), on a
batch of ``--batch`` rows of ``--prompt`` random prompt and ``--response`` random response
tokens with random advantages. Three actor updates (``ActorWorker.update``, the GRPO step's
training part, after ``compute_logprobs`` where the recipe makes more than one optimizer step
per update, as the trainer does): the first creates AdamW's state, the second is measured by
RSS, the third by the profiler. Measured:

* ``rss_base_mb``: RSS before the model is loaded (Python, torch, transformers);
  ``rss_loaded_mb`` after the actor is built; ``peak_rss_mb``: ``ru_maxrss`` after the second
  update; ``train_rss_mb = peak_rss_mb - rss_base_mb``: the training process's own memory
  (weights, gradients, AdamW state, activations, logits) plus what the allocators keep.
* ``live_peak_mb``: the live bytes of torch's CPU allocator at the peak of the third update
  (the storages of parameters, buffers, gradients and AdamW state before it, plus the
  profiler's memory events inside it): the quantity the planner's model is fitted on.

Predicted: ``TrainMemoryModel.peak_bytes`` (``CALIBRATED``) of the shape of one micro-batch of
the update (``rows = min(batch / algo.mini_batches, algo.micro_batch_size)``,
``T = rows (P + R)``, ``r = R / (P + R)``; N, N_t and P_max counted on the built model, single-
tensor AdamW as torch's CPU default): ``predicted_before_mb`` with the LM head on every position
and whole-batch logprob / entropy buffers (the model as it stood before ``logits_to_keep``),
``predicted_mb`` with the head on the ``R + 1`` kept positions per row and the chunked
computation (``logits_kept``, ``chunked_logprobs`` of :class:`relayrl.plan.memory.TrainShape`).

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/smollm2_memory.py \
        [--variants full,lora] [--batch 32] [--prompt 64] [--response 16]

Prints one JSON line per variant. Needs ``relayrl models fetch smollm2`` (run here).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "full": ROOT / "configs" / "grpo_smollm2_arithmetic_full.yaml",
    "lora": ROOT / "configs" / "grpo_smollm2_arithmetic.yaml",
}
MB = float(2**20)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / MB


def _storage_bytes(tensors: list[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _profiled_peak(prof: Any) -> tuple[int, str]:
    """Largest running sum of the profiler's allocator events (bytes above the start) and the
    innermost two ops running at that instant (where the peak is)."""
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    level = peak = 0
    at = 0
    for t, nb in mem:
        level += nb
        if level > peak:
            peak, at = level, t
    ops = [e for e in events if e.name() != "[memory]" and e.start_ns() <= at <= e.end_ns()]
    where = " > ".join(o.name() for o in sorted(ops, key=lambda o: o.start_ns())[-2:])
    return peak, where


def _child(variant: str, args: dict[str, Any], out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from torch.profiler import ProfilerActivity, profile

    from relayrl.config import RunConfig, load_config
    from relayrl.model import pack_batch
    from relayrl.model.batching import keeps_logits
    from relayrl.model.fetch import fetch_model
    from relayrl.plan.memory import CALIBRATED, TrainShape
    from relayrl.workers import Experience
    from relayrl.workers.build import build_actor

    path = str(fetch_model("smollm2"))
    cfg = load_config(RunConfig, RECIPES[variant], [f"model.path={path}", "threads=1"])
    b, p, r = args["batch"], args["prompt"], args["response"]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 49152, (b, p), generator=g).tolist()
    responses = torch.randint(3, 49152, (b, r), generator=g).tolist()
    advantages = torch.randn(b, 1, generator=g).expand(-1, r).clone()

    def experience() -> Experience:
        exp = Experience(pack_batch(prompts, responses, pad_id=2))
        exp.advantages = advantages.clone()
        if not actor.single_update:  # pi_old: the no-grad forward the trainer runs first
            exp.old_logprobs = actor.compute_logprobs(exp)
        return exp

    base_rss = _rss_mb()
    actor = build_actor(cfg, path)
    loaded_rss = _rss_mb()
    model = actor.model
    actor.update(experience())  # AdamW's state exists from here on
    actor.update(experience())
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    trained = [q for q in model.parameters() if q.requires_grad]
    state = [t for st in actor.optimizer.state.values() for t in st.values()]
    held = [*model.parameters(), *model.buffers(), *[q.grad for q in trained if q.grad is not None]]
    base_live = _storage_bytes(held + [t for t in state if isinstance(t, torch.Tensor)])
    exp = experience()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        actor.update(exp)
    peak_bytes, peak_at = _profiled_peak(prof)
    live_peak = base_live + peak_bytes

    conf = model.config if hasattr(model, "config") else model.get_base_model().config
    rows = min(-(-b // cfg.algo.mini_batches), cfg.algo.micro_batch_size)
    shape = dict(
        params=float(sum(q.numel() for q in model.parameters())),
        trainable=float(sum(q.numel() for q in trained)),
        largest_trained=float(max(q.numel() for q in trained)),
        hidden=conf.hidden_size,
        layers=conf.num_hidden_layers,
        vocab=conf.vocab_size,
        tokens=rows * (p + r),
        response_share=r / (p + r),
        lora=variant == "lora",
    )
    before = TrainShape(**shape)  # type: ignore[arg-type]
    after = TrainShape(
        **shape,  # type: ignore[arg-type]
        logits_kept=(r + 1) / (p + r) if keeps_logits(model) else 1.0,
        chunked_logprobs=True,
    )
    pred_before = CALIBRATED.peak_bytes(before) / MB
    pred = CALIBRATED.peak_bytes(after) / MB
    out.put(
        {
            "bench": "smollm2_memory",
            "variant": variant,
            "batch": b,
            "prompt": p,
            "response": r,
            "micro_batch_rows": rows,
            "optimizer_steps_per_update": -(-b // rows),
            "params": int(shape["params"]),
            "trainable": int(shape["trainable"]),
            "rss_base_mb": round(base_rss, 1),
            "rss_loaded_mb": round(loaded_rss, 1),
            "peak_rss_mb": round(peak_rss, 1),
            "train_rss_mb": round(peak_rss - base_rss, 1),
            "live_peak_mb": round(live_peak / MB, 1),
            "live_base_mb": round(base_live / MB, 1),
            "live_peak_at": peak_at,
            "predicted_before_mb": round(pred_before, 1),
            "predicted_mb": round(pred, 1),
            "error_before_vs_live": round((pred_before - live_peak / MB) / (live_peak / MB), 4),
            "error_vs_live": round((pred - live_peak / MB) / (live_peak / MB), 4),
            "error_vs_train_rss": round((pred - (peak_rss - base_rss)) / (peak_rss - base_rss), 4),
            "terms_mb": {k: round(v / MB, 1) for k, v in CALIBRATED.terms(after).items()},
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="full,lora", help="comma-separated: full, lora")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=16)
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for variant in a.variants.split(","):
        if variant not in RECIPES:
            raise SystemExit(f"--variants: unknown variant {variant!r} (known: {list(RECIPES)})")
        q = ctx.Queue()
        proc = ctx.Process(target=_child, args=(variant, vars(a), q))
        proc.start()
        proc.join()  # the result is one small JSON object: the queue never fills
        if proc.exitcode != 0:
            raise SystemExit(f"smollm2_memory: the {variant} child failed (exit {proc.exitcode})")
        result = q.get(timeout=60)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
