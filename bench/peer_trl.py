"""Head-to-head with TRL: relayrl's GRPO (sync and async) against TRL's ``GRPOTrainer``.

TRL lives in its own environment, never in the main lock: on first use the script creates
``.bench-venv/trl`` (``--venv``), a venv whose site-packages sees the main venv's packages
through a ``.pth`` file (torch, transformers, datasets, accelerate are the locked ones; nothing
is downloaded but TRL), and installs ``bench/peer_trl.lock`` into it with ``--no-deps
--require-hashes``, then runs ``pip check`` there. The TRL arm runs in that venv as a
subprocess (``bench/peer_trl_env.py``); the relayrl arms run in this process's environment.

Every arm starts from the same warm-started tiny Llama (2-digit addition), trains on the same
prompts in the same order (relayrl's ``PromptSource`` draws for steps 0..N-1 are TRL's dataset,
unshuffled), with the same batch (``--prompts`` x ``--group``), lr (constant, no warm-up),
Adam (0.9, 0.999, eps 1e-8), grad clip 1, token-mean loss (TRL ``loss_type=dapo``), std-scaled
group advantages, no KL (``beta=0``), temperature 1, fp32, one update per step, the same
completion cap and ``--threads`` torch threads per process (default 1: on this tiny model a
second intra-op thread makes no op faster, and on a loaded machine it makes TRL's and sync
relayrl's steps slower: by how much, docs/measurements.md). TRL and sync relayrl are one
process each (generation and training take turns); async relayrl is two (trainer and engine
process), so it is the one arm that uses the machine's second core: that is what it is measured
for. Checkpoints every ``--eval-every`` steps are scored afterwards by ONE shared greedy
evaluation (relayrl's engine, greedy, 8 tokens, the arithmetic verifier) on held-out prompts
that no arm trains on (relayrl gets them as ``data.eval_path``, which its prompt draws
exclude).

Modes: ``short``: the plain SFT model (answers of 1-4 tokens), cap 8. ``long``: the same model
after a second SFT stage on answer + k filler dots, k ~ lognormal(``--median``,
``--sigma``) (the verifier reads the leading integer, so the filler is neutral for the reward;
``bench/schedules.py``'s task), cap 128: the cap binds in most steps, so generation has a long
tail (TRL's ``generate`` decodes every row to the longest; relayrl's engine frees finished rows,
and async keeps generating while the trainer trains).

Arms: ``relayrl`` (sync, matched to TRL key by key), ``relayrl_async`` (``schedule=async``,
``async.eta=--eta``, its default decoupled PPO loss, otherwise matched), ``trl``; optional
``relayrl_defaults`` (relayrl's own ``mini_batches=2``, ``warmup_steps=10``, betas (0.9, 0.99))
``relayrl_async_naive`` (async with ``policy_loss=ppo``: the clip on the engine's logprobs)
and ``relayrl_async_prox`` (async with ``algo.recompute_old_logprobs=always``: decoupled PPO's
pi_prox from a separate actor forward before the update, which ``relayrl_async`` takes from
the update's own forward: with one update per step they are the same numbers; this arm
measures what the forward costs).

    OMP_NUM_THREADS=1 python bench/peer_trl.py --modes short long --seeds 0 1 2 --steps 40
    python bench/peer_trl.py --dry-run      # the plan: venv, lock, arms and settings; runs nothing

One JSON line per (mode, seed, arm): ``s_per_step``, ``gen_tokens_per_s`` (generated tokens over
the steps' seconds), ``pass_rate`` by step (step 0: the warm start), ``wall_s_to_target``
(summed step seconds up to the first evaluated step at or above ``--target``) and
``wall_s_to_common`` (the same for the highest pass rate every arm of that mode and seed
reached above the warm start), ``gen_s_per_step`` (TRL's ``_generate``, relayrl's generation;
async: the trainer's wait for groups) and ``train_s_per_step`` (relayrl's update); then one
summary line per mode with the means, the per-seed ratios against TRL, and ``mean_curve`` (the
time to a common pass rate on the seed-mean curves). Arms run one after another: on a shared
machine compare replicates, the load moves absolute figures within minutes (by how
much: docs/measurements.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

REPO = Path(__file__).resolve().parents[1]


def _env_module():
    """``bench/peer_trl_env.py`` (TRL's venv and the TRL worker), loaded by path."""
    path = Path(__file__).resolve().with_name("peer_trl_env.py")
    spec = importlib.util.spec_from_file_location("peer_trl_env", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_ENV = _env_module()
LOCK, VENV, WORKER = _ENV.LOCK, _ENV.VENV, _ENV.__file__
lock_pins, venv_plan, ensure_venv = _ENV.lock_pins, _ENV.venv_plan, _ENV.ensure_venv
ARITH = dict(min_operand=0, max_operand=99, operators=["+"], num_operands=2)
MAX_LEN = {"short": 8, "long": 128}
EVAL_TOKENS = 8
ARMS = (
    "relayrl",
    "relayrl_async",
    "trl",
    "relayrl_defaults",
    "relayrl_async_naive",
    "relayrl_async_prox",
)


# --- models, prompts, the shared evaluation ----------------------------------------------


def sft_model(root: Path, seed: int, target: float, threads: int) -> Path:
    """The test fixture's warm start (tests/support/helpers.py ``make_sft_model``), cached in
    ``root``."""
    out = root / f"sft_seed{seed}"
    if (out / "config.json").exists():
        return out
    from relayrl.config import ArithmeticConfig, SFTConfig
    from relayrl.controller.sft import run_sft
    from relayrl.model import build_tiny_model

    base = build_tiny_model(root / f"base_seed{seed}", hidden_size=96, seed=seed)
    held = {p.record.prompt for p in held_out(base, seed, 200)}
    cfg = SFTConfig(seed=seed, model_path=str(base), output_dir=str(out), steps=3000,
                    arithmetic=ArithmeticConfig(**ARITH), eval_every=20, eval_size=200,
                    target_pass_rate=target, threads=threads, progress=False)  # fmt: skip
    print(json.dumps({"sft": run_sft(cfg, exclude_prompts=held)}), flush=True)
    return out


def filler_model(root: Path, sft: Path, seed: int, a: argparse.Namespace) -> Path:
    """The long mode's warm start: ``sft`` after ``--filler-steps`` SFT steps on answer + k
    dots, k = min(cap, floor(exp(ln(median) + sigma z))), z ~ N(0, 1); held-out prompts
    excluded. Cached in ``root`` per (seed, median, sigma, cap, steps, lr)."""
    tag = f"{seed}_m{a.median:g}_s{a.sigma:g}_c{a.filler_cap}_n{a.filler_steps}_lr{a.filler_lr:g}"
    out = root / f"filler_seed{tag}"
    if (out / "config.json").exists():
        return out
    from relayrl.config import ArithmeticConfig, SFTConfig
    from relayrl.controller.sft import run_sft
    from relayrl.data import write_jsonl
    from relayrl.data.prompts import arithmetic_task

    held = {p.record.prompt for p in held_out(sft, seed, 200)}
    rng = random.Random(seed)
    rows = []
    for rec in arithmetic_task(ArithmeticConfig(**ARITH), seed + 1).sft_records(20000):
        if rec.prompt in held:
            continue
        k = min(a.filler_cap, int(math.exp(math.log(a.median) + a.sigma * rng.gauss(0.0, 1.0))))
        rows.append({"prompt": rec.prompt, "response": rec.response + "." * k})
    data = root / f"filler_{tag}.jsonl"
    write_jsonl(data, rows)
    cfg = SFTConfig(seed=seed, model_path=str(sft), output_dir=str(out), task="jsonl",
                    train_path=str(data), steps=a.filler_steps, batch_size=a.filler_batch,
                    lr=a.filler_lr, warmup_steps=0, threads=a.threads, progress=False)  # fmt: skip
    print(json.dumps({"filler_sft": run_sft(cfg)}), flush=True)
    return out


def held_out(model: Path, seed: int, n: int) -> list:
    from relayrl.config import ArithmeticConfig, DataConfig
    from relayrl.data.prompts import PromptSource
    from relayrl.model import load_tokenizer

    data = DataConfig(arithmetic=ArithmeticConfig(**ARITH), eval_size=200)
    return PromptSource(data, load_tokenizer(model), seed).eval_set()[:n]


def write_held_out(path: Path, prompts: list) -> Path:
    from relayrl.data import write_jsonl

    write_jsonl(
        path, [{"prompt": p.record.prompt, "answer": str(p.record.answer)} for p in prompts]
    )
    return path


def shared_eval(model_dir: Path, prompts: list) -> float:
    """Greedy pass rate of the model saved in ``model_dir`` on ``prompts`` (one function for
    every arm: relayrl's engine, greedy, ``EVAL_TOKENS`` tokens, the arithmetic verifier)."""
    from relayrl.model import load_causal_lm, load_tokenizer
    from relayrl.reward.functions import arithmetic
    from relayrl.rollout import GenerationRequest, RolloutEngine, SamplingParams

    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir).eval()
    engine = RolloutEngine(
        model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_slots=64
    )
    params = SamplingParams(greedy=True, max_tokens=EVAL_TOKENS)
    samples = engine.generate([GenerationRequest(p.ids, params) for p in prompts])
    ok = 0
    for p, s in zip(prompts, samples, strict=True):
        text = tok.decode(s.response_ids, skip_special_tokens=True)
        ok += arithmetic(p.record.prompt, text, p.fields()) >= 1.0
    return ok / len(prompts)


# --- the relayrl arms --------------------------------------------------------------------


def relayrl_overrides(a: argparse.Namespace, mode: str, arm: str, held: Path) -> list[str]:
    """Config overrides of a relayrl arm (the keys that TRL sets too, then the schedule)."""
    out = [
        f"algo.prompts_per_step={a.prompts}",
        f"algo.group_size={a.group}",
        "algo.loss_agg=token-mean",
        "algo.kl_coef=0.0",
        f"optim.lr={a.lr}",
        "optim.grad_clip=1.0",
        "optim.weight_decay=0.0",
        f"rollout.max_tokens={MAX_LEN[mode]}",
        "rollout.temperature=1.0",
        f"data.eval_path={held}",
        "data.eval_size=200",
        f"model.gradient_checkpointing={str(a.gradient_checkpointing).lower()}",
    ]
    if arm != "relayrl_defaults":  # TRL's values for what relayrl's defaults set otherwise
        out += ["algo.mini_batches=1", "optim.warmup_steps=0", "optim.betas=[0.9,0.999]"]
    out += [f"threads={a.threads}"]
    if arm.startswith("relayrl_async"):  # the engine's own process, with as many threads
        out += ["schedule=async", f"async.eta={a.eta}", f"rollout.threads={a.threads}"]
    if arm == "relayrl_async_naive":  # clip on the engine's logprobs
        out += ["algo.policy_loss=ppo"]
    if arm == "relayrl_async_prox":  # pi_prox from a separate forward before the update
        out += ["algo.recompute_old_logprobs=always"]
    return out


def run_relayrl(a, mode: str, arm: str, seed: int, model: Path, out: Path, held: Path) -> dict:
    from relayrl.cluster.local import build_local_roles
    from relayrl.config import RunConfig, load_config
    from relayrl.controller.trainer import train

    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={model}",
            f"run_dir={out}",
            f"seed={seed}",
            "logging.progress=false",
            "logging.tensorboard=false",
            f"train.steps={a.steps}",
            f"train.save_every={a.eval_every}",
            f"train.keep_checkpoints={a.steps}",
            *relayrl_overrides(a, mode, arm, held),
        ],
    )
    t = time.perf_counter()
    train(cfg, lambda actor, critic: build_local_roles(cfg, actor, critic))
    wall = time.perf_counter() - t
    ckpts = {
        int(p.name.split("_")[1]): p / "actor"
        for p in (out / "checkpoints").iterdir()
        if p.name.startswith("step_")
    }
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "time/step" in r]
    n = a.prompts * a.group
    return {
        "wall_s": wall,
        "checkpoints": ckpts,
        "step_times": [float(r["time/step"]) for r in steps],
        "gen_tokens": [float(r["response_length_mean"]) * n for r in steps],
        # sync: generation's seconds per step; async: the trainer's wait for finished groups
        "gen_times": [float(r.get("time/generate", r.get("time/wait", 0.0))) for r in steps],
        "train_times": [float(r["time/train"]) for r in steps if "time/train" in r],
    }


# --- the TRL arm (runs in TRL's venv) ----------------------------------------------------


def trl_prompts(model: Path, seed: int, a: argparse.Namespace, held: Path) -> list[dict]:
    """relayrl's draws for steps 0..steps-1, in order (the held-out file excluded, as relayrl's
    runs exclude it): TRL's (unshuffled) dataset."""
    from relayrl.config import RunConfig, load_config
    from relayrl.data.prompts import PromptSource
    from relayrl.model import load_tokenizer

    cfg = load_config(RunConfig, None, [f"seed={seed}", f"data.eval_path={held}"])
    src = PromptSource(cfg.data, load_tokenizer(model), seed)
    return [
        {"prompt": p.record.prompt, "answer": str(p.record.answer)}
        for step in range(a.steps)
        for p in src.for_step(step, a.prompts)
    ]


def trl_config(a: argparse.Namespace, mode: str, seed: int, out: Path) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments: relayrl's matched settings in TRL's names."""
    return dict(
        output_dir=str(out), use_cpu=True, bf16=False, seed=seed, max_steps=a.steps,
        per_device_train_batch_size=a.prompts * a.group, gradient_accumulation_steps=1,
        num_generations=a.group, max_completion_length=MAX_LEN[mode], learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
        scale_rewards="group", num_iterations=1, temperature=1.0, shuffle_dataset=False,
        gradient_checkpointing=a.gradient_checkpointing,
        save_strategy="steps", save_steps=a.eval_every, save_only_model=True, logging_steps=1,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip


def run_trl(a, mode: str, seed: int, model: Path, out: Path, held: Path, py: Path) -> dict:
    """The TRL arm as a subprocess of TRL's venv (``bench/peer_trl_env.py``)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": str(model),
        "threads": a.threads,
        "config": trl_config(a, mode, seed, out / "trl"),
        "prompts": trl_prompts(model, seed, a, held),
        "result": str(out / "result.json"),
    }
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "bench")]))
    env["OMP_NUM_THREADS"] = str(a.threads)
    cmd = [str(py), str(WORKER), str(out / "spec.json")]
    r = subprocess.run(cmd, env=env)
    if r.returncode != 0:
        raise SystemExit(f"the TRL arm failed ({r.returncode}): {' '.join(cmd)}")
    res = json.loads((out / "result.json").read_text())
    res["checkpoints"] = {int(k): Path(v) for k, v in res["checkpoints"].items()}
    return res


# --- figures -----------------------------------------------------------------------------


def wall_to(rates: dict[int, float], step_times: list[float], target: float | None) -> float | None:
    """Summed step seconds up to the first evaluated step whose pass rate is >= ``target``
    (0 at step 0; None if never, or no target)."""
    if target is None:
        return None
    for step, r in sorted(rates.items()):
        if r >= target - 1e-9:
            return round(sum(step_times[:step]), 2)
    return None


def summarise(arm: str, mode: str, seed: int, res: dict, base: float, prompts, a) -> dict:
    rates = {0: base}
    for step, path in sorted(res["checkpoints"].items()):
        rates[step] = shared_eval(path, prompts)
    st = res["step_times"]
    s_per_step = (sum(st) / len(st)) if st else res["wall_s"] / a.steps
    gen = res.get("gen_tokens") or []
    return {
        "bench": "peer_trl",
        "arm": arm,
        "mode": mode,
        "seed": seed,
        "steps": a.steps,
        "threads": a.threads,
        "processes": 2 if arm.startswith("relayrl_async") else 1,
        "s_per_step": round(s_per_step, 4),
        "gen_tokens_per_s": round(sum(gen) / sum(st), 1) if gen and st else None,
        "response_len_mean": round(sum(gen) / len(gen) / (a.prompts * a.group), 2) if gen else None,
        "train_wall_s": round(res["wall_s"], 2),
        # generation seconds per step (async: the trainer's wait) and the update's seconds
        "gen_s_per_step": _mean(res.get("gen_times") or [None]),
        "train_s_per_step": _mean(res.get("train_times") or [None]),
        "pass_rate": {str(k): round(v, 3) for k, v in rates.items()},
        "target": a.target,
        "wall_s_to_target": wall_to(rates, st, a.target),
        "step_times": [round(t, 4) for t in st],
    }


def add_common(rows: list[dict]) -> None:
    """Per (mode, seed): the common target is the lowest of the arms' best pass rates, if it is
    above the warm start's; each row gets ``common_target`` and ``wall_s_to_common``."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["seed"]), []).append(r)
    for group in groups.values():
        base = group[0]["pass_rate"]["0"]
        common = min(max(r["pass_rate"].values()) for r in group)
        target = common if common > base else None
        for r in group:
            rates = {int(k): v for k, v in r["pass_rate"].items()}
            r["common_target"] = target
            r["wall_s_to_common"] = wall_to(rates, r["step_times"], target)


def summary(rows: list[dict]) -> list[dict]:
    """Per mode: each arm's means; per seed its time to the common target over TRL's; and on
    the seed-mean curves (mean pass rate and mean summed step seconds at each evaluated step)
    the same figure, ``mean_curve``: the lowest of the arms' best mean pass rates (if above
    the warm start), the step and mean seconds each arm first reaches it, over TRL's."""
    out = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mrows = [r for r in rows if r["mode"] == mode]
        arms: dict[str, Any] = {}
        for arm in dict.fromkeys(r["arm"] for r in mrows):
            ar = [r for r in mrows if r["arm"] == arm]
            steps = sorted({int(k) for r in ar for k in r["pass_rate"]})
            arms[arm] = {
                "n": len(ar),
                "s_per_step": _mean(r["s_per_step"] for r in ar),
                "gen_tokens_per_s": _mean(r["gen_tokens_per_s"] for r in ar),
                "response_len_mean": _mean(r["response_len_mean"] for r in ar),
                "pass_rate": {str(s): _mean(r["pass_rate"].get(str(s)) for r in ar) for s in steps},
                "wall_s_to_common": [r.get("wall_s_to_common") for r in ar],
                "mean_wall_s": {
                    str(s): _mean(sum(r["step_times"][:s]) for r in ar if str(s) in r["pass_rate"])
                    for s in steps
                },
            }
            trl = {r["seed"]: r for r in mrows if r["arm"] == "trl"}
            ratios = []
            for r in ar:
                t = trl.get(r["seed"])
                if arm != "trl" and t and r.get("wall_s_to_common") and t.get("wall_s_to_common"):
                    ratios.append(round(r["wall_s_to_common"] / t["wall_s_to_common"], 3))
            if arm != "trl":
                arms[arm]["s_per_step_over_trl"] = _ratio(ar, trl, "s_per_step")
                arms[arm]["time_to_common_over_trl"] = ratios
        out.append({"bench": "peer_trl", "summary": mode, "arms": arms, "mean_curve": _curve(arms)})
    return out


def _curve(arms: dict[str, Any]) -> dict[str, Any]:
    base = min(d["pass_rate"]["0"] for d in arms.values())
    target = min(max(d["pass_rate"].values()) for d in arms.values())
    if target <= base:
        return {"target": None}
    hit = {}
    for arm, d in arms.items():
        s = min(int(k) for k, v in d["pass_rate"].items() if v >= target - 1e-9)
        hit[arm] = {"step": s, "wall_s": d["mean_wall_s"][str(s)]}
    t = hit.get("trl", {}).get("wall_s")
    for h in hit.values():
        h["over_trl"] = round(h["wall_s"] / t, 3) if t else None
    return {"target": target, "arms": hit}


def _mean(xs) -> float | None:
    v = [x for x in xs if x is not None]
    return round(sum(v) / len(v), 4) if v else None


def _ratio(ar: list[dict], trl: dict[int, dict], key: str) -> list[float]:
    return [round(r[key] / trl[r["seed"]][key], 3) for r in ar if r["seed"] in trl]


# --- driver ------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["short", "long"], choices=list(MAX_LEN))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", default=["relayrl", "relayrl_async", "trl"], choices=ARMS)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4, help="at 5e-4 every arm collapsed (s3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--eta", type=int, default=2, help="async.eta of relayrl_async")
    ap.add_argument(
        "--gradient-checkpointing", action="store_true",
        help="both sides recompute activations (TRL's GRPOConfig defaults to on, relayrl to off;"
        " without this flag both are off)",
    )  # fmt: skip
    ap.add_argument("--target", type=float, default=None, help="a fixed pass rate to time too")
    ap.add_argument("--sft-target", type=float, default=0.35)
    ap.add_argument("--sft-seed", type=int, default=0, help="one warm start for every run seed")
    ap.add_argument("--median", type=float, default=12.0, help="long mode: filler median")
    ap.add_argument("--sigma", type=float, default=1.5, help="long mode: filler log-std")
    ap.add_argument("--filler-cap", type=int, default=200, help="long mode: longest filler")
    ap.add_argument("--filler-steps", type=int, default=200)
    ap.add_argument("--filler-batch", type=int, default=32)
    ap.add_argument("--filler-lr", type=float, default=1e-3)
    ap.add_argument("--venv", default=str(VENV), help="TRL's venv (created on first use)")
    ap.add_argument("--lock", default=str(LOCK))
    ap.add_argument("--work", default=os.environ.get("RELAYRL_BENCH_DIR", "bench_out/peer_trl"))
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories")
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    a = ap.parse_args(argv)
    for k in ("steps", "eval_every", "prompts", "threads"):
        if getattr(a, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    if a.group < 2:
        ap.error("--group must be >= 2 (group advantages)")
    return a


def plan(a: argparse.Namespace) -> dict[str, Any]:
    """Everything a run would do, without building a model or touching TRL."""
    need_trl = "trl" in a.arms
    held = Path(a.work) / "held_out.jsonl"
    return {
        "bench": "peer_trl",
        "plan": {
            "trl_env": venv_plan(Path(a.venv), Path(a.lock)) if need_trl else None,
            "work": a.work,
            "runs": [(m, s, arm) for s in a.seeds for m in a.modes for arm in a.arms],
            "modes": {
                m: {
                    "max_completion_tokens": MAX_LEN[m],
                    "warm_start": f"sft_seed{a.sft_seed}"
                    + (
                        f" + filler k~lognormal({a.median}, {a.sigma})<= {a.filler_cap}"
                        if m == "long"
                        else ""
                    ),  # fmt: skip
                    "relayrl": {
                        arm: relayrl_overrides(a, m, arm, held) for arm in a.arms if arm != "trl"
                    },  # fmt: skip
                    "trl": trl_config(a, m, 0, Path(a.work) / "trl") if need_trl else None,
                }
                for m in a.modes
            },
        },
    }


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.dry_run:
        print(json.dumps(plan(a), indent=1))
        return 0
    import torch

    torch.set_num_threads(a.threads)
    py = ensure_venv(Path(a.venv), Path(a.lock)) if "trl" in a.arms else None
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sft = sft_model(work, a.sft_seed, a.sft_target, a.threads)
    prompts = held_out(sft, a.sft_seed, a.eval_prompts)
    held = write_held_out(work / "held_out.jsonl", held_out(sft, a.sft_seed, 200))
    models = {"short": sft}
    if "long" in a.modes:
        models["long"] = filler_model(work, sft, a.sft_seed, a)
    base = {m: shared_eval(models[m], prompts) for m in a.modes}
    rows = []
    for seed in a.seeds:
        for mode in a.modes:
            for arm in a.arms:
                out = work / f"{arm}_{mode}_seed{seed}"
                shutil.rmtree(out, ignore_errors=True)
                if arm == "trl":
                    assert py is not None
                    res = run_trl(a, mode, seed, models[mode], out, held, py)
                else:
                    res = run_relayrl(a, mode, arm, seed, models[mode], out, held)
                row = summarise(arm, mode, seed, res, base[mode], prompts, a)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if not a.keep:
                    shutil.rmtree(out, ignore_errors=True)
    add_common(rows)
    for r in rows:
        keys = ("arm", "mode", "seed", "common_target", "wall_s_to_common")
        print(json.dumps({"bench": "peer_trl"} | {k: r[k] for k in keys}))
    for s in summary(rows):
        print(json.dumps(s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
