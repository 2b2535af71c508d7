"""Peak memory of one training forward + backward of SmolLM2-135M-Instruct (49,152-token
vocabulary) through ``relayrl.model.forward_logprobs`` (logprobs and entropy, as the actor's
update computes them), against the size of one fp32 logits tensor.

Each configuration runs in a fresh child process: RSS after loading the model (and one
one-token warm-up forward) and the peak RSS (``ru_maxrss``) after the step; the step's extra
memory is their difference. ``logits_mb`` = B * (P + R) * V * 4 bytes / 2^20, the logits of the
whole sequence at fp32 (what a forward without ``logits_to_keep`` materialises, before its
gradient); ``response_logits_mb`` = B * (R + 1) * V * 4 / 2^20.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/smollm2_memory.py \
        [--batch 32] [--prompt 64] [--response 16] [--lora]

Prints one JSON line per configuration. Needs ``relayrl models fetch smollm2`` (run here).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
from typing import Any


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _child(args: dict[str, Any], out: Any) -> None:
    import torch

    torch.set_num_threads(1)
    from relayrl.model import forward_logprobs, load_causal_lm, pack_batch
    from relayrl.model.fetch import fetch_model

    model = load_causal_lm(fetch_model("smollm2"))
    if args["lora"]:
        from relayrl.config import LoraConfig
        from relayrl.model.lora import apply_lora

        model = apply_lora(model, LoraConfig(r=16, alpha=32))
    model.train()
    b, p, r = args["batch"], args["prompt"], args["response"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        forward_logprobs(model, pack_batch([[1]], [[2]], pad_id=2))
    before = _rss_mb()
    prompts = torch.randint(3, 49152, (b, p), generator=g).tolist()
    responses = torch.randint(3, 49152, (b, r), generator=g).tolist()
    batch = pack_batch(prompts, responses, pad_id=2)
    logp, ent = forward_logprobs(model, batch, with_entropy=True)
    assert ent is not None
    (logp.sum() + 0.01 * ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    v = 49152
    out.put(
        {
            "bench": "smollm2_memory",
            "lora": args["lora"],
            "batch": b,
            "prompt": p,
            "response": r,
            "rss_after_load_mb": round(before, 1),
            "peak_rss_mb": round(peak, 1),
            "step_extra_mb": round(peak - before, 1),
            "logits_mb": round(b * (p + r) * v * 4 / 2**20, 1),
            "response_logits_mb": round(b * (r + 1) * v * 4 / 2**20, 1),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--lora", action="store_true", help="LoRA adapters (r 16) on attention")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(vars(a), q))
    proc.start()
    result = q.get()
    proc.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
