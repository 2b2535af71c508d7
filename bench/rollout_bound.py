"""How close the engine could come to its ceiling if its steps cost no more than the ceiling's.

``bench/rollout.py`` compares the engine on heavy-tailed requests with a ceiling: the same
useful tokens as uniform requests of the mean length, every slot busy, no tail. This replays
both runs' schedules (rows per step) against one cost line measured on plain decode steps,
``t(b) = t(1) + (b - 1) (t(32) - t(1)) / 31`` (``b`` rows, context 40, nothing admitted;
``relayrl.rollout.timing.engine_timings``):
``bound = sum_ceiling t(b) / sum_engine t(b)`` is the ratio the engine would reach if every
step cost what a decode step with as many rows costs, i.e. what the tail alone leaves (a step
is mostly fixed cost on a small model, so nearly-empty tail steps cost nearly full ones).
The measured ratio of the same runs is printed beside it; the gap between the two is what
admissions and longer contexts cost. Prints ONE JSON line.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/rollout_bound.py [--requests 512]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import rollout as bench  # noqa: E402

from relayrl.model.loading import load_causal_lm  # noqa: E402
from relayrl.model.tiny import build_tiny_model  # noqa: E402
from relayrl.rollout import RolloutEngine  # noqa: E402
from relayrl.rollout.timing import engine_timings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    max_len = 32 + 256 + 1
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(
            Path(tmp) / "m",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=max_len,
        )
        model = load_causal_lm(path).eval()
        prompts, targets = bench.workload(args.requests, 24.0, 1.0, 256, 0)
        bench.run_engine(model, prompts[:8], [4] * 8, args.slots, max_len)  # warm-up
        mean_len = max(1, round(sum(targets) / len(targets)))
        uniform = [mean_len] * len(prompts)
        engine_tps, _, engine = bench.run_engine(model, prompts, targets, args.slots, max_len)
        ceiling_tps, _, ceiling = bench.run_engine(model, prompts, uniform, args.slots, max_len)
        idle = RolloutEngine(
            model,
            eos_token_id=bench.EOS,
            pad_token_id=bench.PAD,
            max_slots=args.slots,
            max_model_len=max_len,
        )
        vocab = model.get_input_embeddings().num_embeddings
        steps = engine_timings(idle, vocab, batches=(1, args.slots), context=40)["decode_step_s"]
    t1, tn = steps[1], steps[args.slots]  # type: ignore[index]
    per_row = (tn - t1) / (args.slots - 1)
    cost = lambda rows: sum(t1 + (b - 1) * per_row for b in rows)  # noqa: E731
    engine_rows, ceiling_rows = engine["step_rows"], ceiling["step_rows"]
    r = lambda x: round(x, 3)  # noqa: E731
    print(
        json.dumps(
            {
                "bench": "rollout_bound",
                "requests": args.requests,
                "slots": args.slots,
                "engine_steps": len(engine_rows),
                "ceiling_steps": len(ceiling_rows),
                "slot_utilisation": r(sum(engine_rows) / (args.slots * len(engine_rows))),
                "decode_step_ms": {"1": r(1e3 * t1), str(args.slots): r(1e3 * tn)},
                # the same useful tokens in both runs: the ratio of rates is the ratio of times
                "measured_ratio": r(engine_tps / ceiling_tps),
                "bound_same_step_costs": r(cost(ceiling_rows) / cost(engine_rows)),
            }
        )
    )


if __name__ == "__main__":
    main()
