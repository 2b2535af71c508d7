"""The Tinker service's overhead: a GRPO-style loop written against the Tinker SDK, run through
``relayrl tinker-serve``, against relayrl's own trainer on the same task, model and batch.

Both arms: the same tiny Llama (``--hidden``), warm-started by relayrl's SFT on 2-digit
addition (``--sft-steps``, cached in ``--out``), full-parameter training, relayrl's arithmetic
prompts (each arm its own draws from one distribution), ``--prompts`` x ``--group`` samples per
step at temperature 1 with ``--max-tokens``, the ``arithmetic`` verifier, group-mean
advantages, groups whose rewards are all equal left out (as the cookbook's ``rl_loop.py``
does; a step with none left trains nothing), one optimizer step per batch, Adam at ``--lr``,
one torch thread per process.

- ``relayrl``: ``relayrl.controller.trainer.train`` (sync schedule, GRPO, no KL, one
  mini-batch), seconds per step from its ``time/step`` metric.
- ``tinker_sdk``: the service as its own process (``relayrl tinker-serve --threads 1``) and, in
  this process, the SDK loop the Tinker docs and the cookbook's ``rl_loop.py`` use:
  ``save_weights_and_get_sampling_client`` -> one ``sample`` per prompt (``num_samples =
  group``) -> rewards -> ``forward_backward(importance_sampling)`` + ``optim_step``; seconds per
  step by the wall clock around that.

The loss and advantage scaling differ (the Tinker loss is a sum; relayrl's default is a
token mean with std-scaled advantages), which changes what is learned, not the work done per
step: the figure is throughput. Prints one JSON line per arm and a summary line with
``overhead`` = tinker_sdk median s/step / relayrl median s/step.

    OMP_NUM_THREADS=1 python bench/tinker_service.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="working directory (default: a temp dir)")
    return p.parse_args(argv)


def warm_model(a: argparse.Namespace, work: Path) -> Path:
    """The tiny Llama after ``--sft-steps`` of relayrl's SFT on 2-digit addition (cached)."""
    out = work / f"sft_h{a.hidden}_s{a.sft_steps}_seed{a.seed}"
    if (out / "config.json").exists():
        return out
    from relayrl.config import ArithmeticConfig, SFTConfig
    from relayrl.controller.sft import run_sft
    from relayrl.model import build_tiny_model

    base = build_tiny_model(work / f"base_h{a.hidden}_seed{a.seed}", hidden_size=a.hidden,
                            seed=a.seed)  # fmt: skip
    arith = ArithmeticConfig(min_operand=0, max_operand=99, operators=["+"], num_operands=2)
    cfg = SFTConfig(seed=a.seed, model_path=str(base), output_dir=str(out), steps=a.sft_steps,
                    arithmetic=arith, eval_every=a.sft_steps, eval_size=100, threads=1,
                    progress=False)  # fmt: skip
    print(json.dumps({"sft": run_sft(cfg)}), flush=True)
    return out


def run_relayrl(a: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    from relayrl.cluster.local import build_local_roles
    from relayrl.config import RunConfig, load_config
    from relayrl.controller.trainer import train

    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={model}",
            f"run_dir={out / 'run'}",
            f"seed={a.seed}",
            "logging.progress=false",
            "logging.tensorboard=false",
            f"train.steps={a.steps}",
            f"algo.prompts_per_step={a.prompts}",
            f"algo.group_size={a.group}",
            "algo.kl_coef=0.0",
            "algo.mini_batches=1",
            f"optim.lr={a.lr}",
            "optim.warmup_steps=0",
            f"rollout.max_tokens={a.max_tokens}",
            "rollout.temperature=1.0",
            "threads=1",
        ],
    )
    train(cfg, lambda actor, critic: build_local_roles(cfg, actor, critic))
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [float(r["time/step"]) for r in rows if "time/step" in r]
    rewards = [float(r["reward_mean"]) for r in rows if "reward_mean" in r]
    phases = {
        "sample_s": [float(r["time/generate"]) for r in rows if "time/generate" in r],
        "train_s": [float(r["time/train"]) for r in rows if "time/train" in r],
    }
    return {
        "step_s": steps,
        "reward": rewards,
        "phases": {k: statistics.median(v[1:] or v) for k, v in phases.items() if v},
    }


def _start_service(model: Path, state: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "relayrl.cli",
        "tinker-serve",
        str(model),
        "--port",
        "0",
        "--state-dir",
        str(state),
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "relayrl tinker-serve: http://" in line:
            return proc, line.split()[2]
    raise RuntimeError(f"tinker-serve exited with {proc.wait()}")


def run_tinker_sdk(a: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    import numpy as np
    import tinker
    from tinker import types

    from relayrl.data.arithmetic import ArithmeticTask
    from relayrl.reward.functions import arithmetic

    proc, url = _start_service(model, out / "state")
    try:
        client = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = client.create_lora_training_client(base_model=str(model), rank=0).result()
        tok = tc.get_tokenizer()
        task = ArithmeticTask(seed=a.seed)
        params = types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0)
        adam = types.AdamParams(learning_rate=a.lr)
        step_s, rewards, phases = [], [], {"save_s": [], "sample_s": [], "train_s": []}
        for _ in range(a.steps):
            t = time.perf_counter()
            sampler = tc.save_weights_and_get_sampling_client().result()
            t_saved = time.perf_counter()
            records = task.sample(a.prompts)
            prompts = [tok.encode(r.prompt) for r in records]
            futs = [sampler.sample(types.ModelInput.from_ints(p), a.group, params) for p in prompts]
            data, all_r = [], []
            results = [f.result() for f in futs]
            t_sampled = time.perf_counter()
            for rec, prompt, res in zip(records, prompts, results, strict=True):
                seqs = res.sequences
                rs = [
                    arithmetic(
                        rec.prompt, tok.decode(s.tokens, skip_special_tokens=True), rec.as_sample()
                    )
                    for s in seqs
                ]
                all_r += rs
                if len(set(rs)) == 1:  # no signal in this group (the cookbook skips it too)
                    continue
                for s, r in zip(seqs, rs, strict=True):
                    pad = [0.0] * (len(prompt) - 1)
                    full = prompt + s.tokens
                    data.append(
                        types.Datum(
                            model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={
                                "target_tokens": full[1:],
                                "logprobs": pad + list(s.logprobs),
                                "advantages": pad + [r - float(np.mean(rs))] * len(s.tokens),
                            },
                        )
                    )
            if data:
                tc.forward_backward(data, "importance_sampling")
                tc.optim_step(adam).result()
            step_s.append(time.perf_counter() - t)
            phases["save_s"].append(t_saved - t)
            phases["sample_s"].append(t_sampled - t_saved)
            phases["train_s"].append(time.perf_counter() - t_sampled)
            rewards.append(float(np.mean(all_r)))
        return {
            "step_s": step_s,
            "reward": rewards,
            "phases": {k: statistics.median(v[1:] or v) for k, v in phases.items()},
        }
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)

    work = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="tinker_bench_"))
    model = warm_model(a, work)
    results = {}
    for arm, fn in (("relayrl", run_relayrl), ("tinker_sdk", run_tinker_sdk)):
        res = fn(a, model, Path(tempfile.mkdtemp(prefix=f"{arm}_", dir=work)))
        steady = res["step_s"][1:] or res["step_s"]
        results[arm] = statistics.median(steady)
        print(
            json.dumps(
                {
                    "arm": arm,
                    "steps": len(res["step_s"]),
                    "s_per_step_median": round(results[arm], 4),
                    "s_per_step_first": round(res["step_s"][0], 4),
                    "reward_first": res["reward"][0] if res["reward"] else None,
                    "reward_last": res["reward"][-1] if res["reward"] else None,
                    "prompts": a.prompts,
                    "group": a.group,
                    "max_tokens": a.max_tokens,
                    **{f"median_{k}": round(v, 4) for k, v in res.get("phases", {}).items()},
                }
            ),
            flush=True,
        )
    print(
        json.dumps(
            {
                "summary": "tinker_service",
                "overhead": round(results["tinker_sdk"] / results["relayrl"], 3),
                **{f"{k}_s_per_step": round(v, 4) for k, v in results.items()},
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
