"""Head-to-head with TRL on a real model: SmolLM2-135M-Instruct, reasoning-gym basic_arithmetic.

relayrl's GRPO (the LoRA recipe ``configs/grpo_smollm2_arithmetic.yaml``) against TRL's
``GRPOTrainer`` (in TRL's own venv, ``bench/peer_trl_env.py``, as ``bench/peer_trl.py`` runs it),
both from the fetched SmolLM2-135M-Instruct (``relayrl models fetch smollm2``; Q4_1 dequantised,
so figures are this conversion's, not the original model's). Arms (``--arms``, all by default):

- ``relayrl``: the recipe, sync schedule, relayrl's own engine, in this process;
- ``relayrl-async``: the same with ``schedule=async`` (the ``async`` section's defaults:
  staleness bound eta 2, interrupting updates, groups trained in admission order; the engine in
  its own worker process, ``rollout.threads`` 1);
- ``relayrl-vllm``: the same (sync) with ``rollout.backend=vllm``, run by ``--vllm-python``
  (``.vllm-venv``, ``make vllm-venv``: vLLM is not in the main venv) through this file's
  ``--worker`` mode (the main venv's packages behind its own: ``worker``); KV cache 0.5 GiB
  (SmolLM2's 8192-token context needs 0.35); without that venv, or if it fails, one JSON line
  says why and the bench goes on;
- ``trl``: TRL's ``GRPOTrainer``.

Matched: the starting weights (the fetched directory; each side adds LoRA adapters whose B is
zero, so both start from the same function); the prompts, in order (relayrl's ``PromptSource``
draws for steps 0..N-1, rendered with the recipe's chat template and system prompt; TRL gets the
rendered text, unshuffled, and the bench checks that TRL's tokenizer call gives the same ids);
the reward (reasoning-gym's own scorer through ``relayrl.reward.task_rewards.reasoning_gym_score``
on the completion decoded without special tokens); ``--prompts`` x ``--group`` a step; the
LoRA adapters (the recipe's rank, alpha, dropout and target modules); lr constant with no
warm-up, Adam (0.9, 0.999, eps 1e-8), no weight decay, grad clip 1; token-mean loss (TRL
``loss_type=dapo``), std-scaled group advantages, no KL (``beta=0``), one update per step;
temperature 1, ``--max-tokens`` new tokens; fp32; no gradient checkpointing on either side
(TRL's default is on: turned off); ``--threads`` torch threads, one process each.

Measured: held-out greedy accuracy at steps 0, K, 2K, ..., N (``--eval-every K``; 0: before
and after only) by ONE evaluation for every model: ``relayrl eval`` in its own process on the
recipe's held-out problems, ``--eval-size`` of them, never trained on, on the base model (step
0, shared by the arms) and on each arm's merged LoRA model saved after those steps (relayrl:
``train.save_every=K``, every checkpoint kept; TRL: a callback after the step's timer). Wall
seconds per step and CPU seconds per step (user + system of the process and its live children,
the async engine worker and vLLM's engine core included: relayrl's ``schedule.step``; TRL's
``on_step_begin`` .. ``on_step_end``, its process's CPU clock), the generation's share; per step
the training reward and grad norm, and ``weight_delta_l2`` (how far each arm moved the merged
model from the base). Each arm's curve: points (step, training wall s so far, training CPU s
so far, accuracy), training time = the sum of the step times before that step
(``peer_trl_curves``). Per seed: the common target (``--target``, or the highest accuracy every
arm reached) and each arm's training wall and CPU seconds to first reach it, with the ratios
arm / TRL; also per-step ratios arm / TRL. One JSON line per (seed, arm), one per seed, and
with several seeds one with the median ratios over the seeds.

Not training time: evaluation, checkpoint saving, model loading, vLLM's start-up. The async
arm's engine keeps generating while the trainer saves a checkpoint (outside the step), so its
summed step time is a little below its wall time with the saves.

    OMP_NUM_THREADS=1 PYTHONPATH=src .venv/bin/python bench/peer_trl_smollm2.py \\
        [--seeds 0 1 2] [--arms relayrl relayrl-async relayrl-vllm trl] [--steps 5]
        [--prompts 8] [--group 8] [--eval-size 100] [--eval-every 0] [--target ACC] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "grpo_smollm2_arithmetic.yaml"
ARMS = ("relayrl", "relayrl-async", "relayrl-vllm", "trl")
ARM_OVERRIDES = {
    "relayrl": [],
    "relayrl-async": ["schedule=async"],  # async.* the defaults: eta 2, interrupt, in order
    # sync; vLLM in the trainer's process. Its KV cache must hold one sequence of the model's
    # whole context (SmolLM2: 8192 tokens, 0.35 GiB): the default 0.25 GiB does not start
    "relayrl-vllm": ["rollout.backend=vllm", "rollout.vllm_kv_cache_gib=0.5"],
}
"""The relayrl arms: the recipe (sync, own engine), its async schedule, its vLLM backend."""
VLLM_PY = REPO / ".vllm-venv" / "bin" / "python"


def _load(name: str) -> Any:
    """``bench/<name>.py``, loaded by path (the scripts are not a package)."""
    import importlib.util

    path = Path(__file__).resolve().with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


curves = _load("peer_trl_curves")


def _env_module() -> Any:
    """``bench/peer_trl_env.py`` (TRL's venv and the TRL worker), loaded by path."""
    import importlib.util

    path = Path(__file__).resolve().with_name("peer_trl_env.py")
    spec = importlib.util.spec_from_file_location("peer_trl_env", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- the matched settings ----------------------------------------------------------------


def relayrl_overrides(a: argparse.Namespace, seed: int, model: str, run_dir: Path,
                      arm: str = "relayrl") -> list[str]:  # fmt: skip
    """Overrides of the recipe for a relayrl arm: TRL's values where the recipe differs, a
    merged checkpoint every ``--eval-every`` steps (all kept), then the arm's own."""
    return [
        f"model.path={model}",
        f"run_dir={run_dir}",
        f"seed={seed}",
        f"train.steps={a.steps}",
        "train.eval_every=0",
        f"train.save_every={a.eval_every if 0 < a.eval_every < a.steps else 0}",  # + the last
        f"train.keep_checkpoints={a.steps + 1}",
        "model.lora.save_merged=true",
        "model.gradient_checkpointing=false",
        f"data.eval_size={a.eval_size}",
        f"algo.prompts_per_step={a.prompts}",
        f"algo.group_size={a.group}",
        "algo.loss_agg=token-mean",
        "algo.kl_coef=0.0",
        "algo.mini_batches=1",
        f"optim.lr={a.lr}",
        "optim.warmup_steps=0",
        "optim.betas=[0.9,0.999]",
        "optim.weight_decay=0.0",
        "optim.grad_clip=1.0",
        f"rollout.max_tokens={a.max_tokens}",
        "rollout.temperature=1.0",
        f"threads={a.threads}",
        "logging.progress=false",
        "logging.tensorboard=false",
        *ARM_OVERRIDES[arm],
    ]


def trl_config(a: argparse.Namespace, seed: int, out: Path) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments: the relayrl arm's settings in TRL's names."""
    return dict(
        output_dir=str(out), use_cpu=True, bf16=False, seed=seed, max_steps=a.steps,
        per_device_train_batch_size=a.prompts * a.group, gradient_accumulation_steps=1,
        num_generations=a.group, max_completion_length=a.max_tokens, learning_rate=a.lr,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
        scale_rewards="group", num_iterations=1, temperature=1.0, shuffle_dataset=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": "float32"},
        save_strategy="no", logging_steps=1, report_to=[], disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip


def lora_spec(lora: Any) -> dict[str, Any]:
    """``peft.LoraConfig`` keyword arguments of the recipe's ``model.lora`` (as
    ``relayrl.model.lora.apply_lora`` builds them)."""
    return dict(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules), bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip


def trl_rows(prompts: list[Any], tokenizer: Any) -> list[dict[str, Any]]:
    """TRL's dataset rows for relayrl's tokenised prompts: ``prompt`` the rendered text (chat
    template and system prompt included), ``question`` the problem as the reward sees it,
    ``answer``, and reasoning-gym's fields (the metadata as JSON text: Arrow needs one schema).
    Raises if the tokenizer does not give the prompt's ids back from its text (TRL tokenises
    a string prompt with ``processing_class(text=...)``)."""
    rows = []
    for p in prompts:
        text = tokenizer.decode(p.ids)
        again = tokenizer(text=text)["input_ids"]
        if list(again) != list(p.ids):
            raise ValueError(f"the rendered prompt does not tokenise back to its ids: {text!r}")
        f = p.fields()
        meta = json.dumps(f.get("rg_metadata"))
        rows.append({"prompt": text, "question": f["prompt"], "answer": f["answer"],
                     "rg_task": f["rg_task"], "rg_metadata": meta})  # fmt: skip
    return rows


def ratios(relayrl: dict[str, Any], trl: dict[str, Any], keys: tuple[str, ...],
           name: str = "relayrl") -> dict[str, Any]:  # fmt: skip
    """The ``name`` arm's figure over TRL's for each key (None where TRL's is 0 or missing)."""
    out: dict[str, Any] = {}
    for k in keys:
        r, t = relayrl.get(k), trl.get(k)
        out[f"{k}_{name}_over_trl"] = round(r / t, 3) if r is not None and t else None
    return out


def median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


# --- the arms ----------------------------------------------------------------------------


def cpu_now() -> float:
    """CPU seconds (user + system) of this process and its live descendants (the async
    schedule's engine worker, vLLM's engine core): ``time.process_time`` + psutil's."""
    import psutil

    total = time.process_time()
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # ended meanwhile
            pass
    return total


def run_relayrl(a: argparse.Namespace, seed: int, model: str, out: Path, arm: str = "relayrl"
                ) -> dict[str, Any]:  # fmt: skip
    """The recipe's own trainer (``arm``'s overrides); the merged LoRA model of each saved
    step and the step figures. CPU seconds per step: ``cpu_now`` around ``schedule.step``
    (the trainer's step as ``time/step`` times it)."""
    import relayrl.controller.trainer as trainer_mod
    from relayrl.cluster.local import build_local_roles
    from relayrl.config import RunConfig, load_config

    cfg = load_config(RunConfig, Path(a.config), relayrl_overrides(a, seed, model, out, arm))
    cpu: list[float] = []
    make = trainer_mod.make_schedule

    def timed_schedule(*args: Any, **kw: Any) -> Any:
        schedule = make(*args, **kw)
        step = schedule.step

        def cpu_step(*sa: Any, **skw: Any) -> Any:
            c0 = cpu_now()
            res = step(*sa, **skw)
            cpu.append(cpu_now() - c0)
            return res

        schedule.step = cpu_step
        return schedule

    trainer_mod.make_schedule = timed_schedule  # type: ignore[assignment]
    try:
        t = time.perf_counter()
        final = trainer_mod.train(cfg, lambda act, cri: build_local_roles(cfg, act, cri))
        wall = time.perf_counter() - t
    finally:
        trainer_mod.make_schedule = make  # type: ignore[assignment]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]
    saved = {int(p.parent.name.split("_")[1]): str(p)
             for p in (out / "checkpoints").glob("step_*/actor_merged")}  # fmt: skip
    return {
        "model_out": saved[max(saved)],
        "saved": saved,
        "wall_s": wall,
        "step_times": [float(r["time/step"]) for r in rows],
        "cpu_times": cpu,
        # the sync schedule times its generation; async's runs beside the trainer: none
        "gen_times": [float(r["time/generate"]) for r in rows if "time/generate" in r],
        "reward_mean": [round(float(r["reward_mean"]), 4) for r in rows],
        "grad_norm": [round(float(r.get("actor/grad_norm", float("nan"))), 4) for r in rows],
        "own_eval": [final.get("eval_before"), final.get("eval_after")],
    }


def run_relayrl_elsewhere(a: argparse.Namespace, seed: int, model: str, out: Path, arm: str,
                          py: Path) -> dict[str, Any] | str:  # fmt: skip
    """``run_relayrl`` in another venv's python (the vLLM arm: ``.vllm-venv``), this file's
    ``--worker`` mode; its result, or one line saying why there is none."""
    if not py.exists():
        return f"no vLLM venv python at {py} (make vllm-venv, or --vllm-python)"
    out.mkdir(parents=True, exist_ok=True)
    args = {k: v for k, v in vars(a).items() if k != "base_model"}
    import sysconfig

    paths = sysconfig.get_paths()  # this (the main) venv's site-packages: see ``worker``
    spec = {"args": args, "seed": seed, "model": model, "out": str(out), "arm": arm,
            "result": str(out / "result.json"),
            "fallback_site": list(dict.fromkeys([paths["purelib"], paths["platlib"]]))}  # fmt: skip
    (out / "worker.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS=str(a.threads))
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("VLLM_CACHE_ROOT", str(py.parents[1] / "vllm-cache"))
    log = out.parent / f"{out.name}.log"
    with log.open("w") as f:
        cmd = [str(py), str(Path(__file__).resolve()), "--worker", str(out / "worker.json")]
        rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not (out / "result.json").exists():
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
        return f"{arm} failed (exit {rc}, log {log}): {lines[-1].strip() if lines else ''}"
    res = json.loads((out / "result.json").read_text())
    res["saved"] = {int(k): v for k, v in res["saved"].items()}
    return res


def worker(spec_path: str) -> int:
    """``--worker SPEC``: one relayrl arm in this python, its result as JSON. The main venv's
    site-packages (``fallback_site``) are appended to ``sys.path`` after this venv's own, so a
    package this venv lacks comes from the main venv and one it has is its own
    (``requirements-vllm.lock`` predates reasoning-gym, which the recipe's data needs)."""
    import site

    spec = json.loads(Path(spec_path).read_text())
    for path in spec.get("fallback_site", []):
        site.addsitedir(path)
    import torch

    a = argparse.Namespace(**spec["args"])
    torch.set_num_threads(a.threads)
    res = run_relayrl(a, spec["seed"], spec["model"], Path(spec["out"]), spec["arm"])
    Path(spec["result"]).write_text(json.dumps(res))
    return 0


def run_trl(a: argparse.Namespace, seed: int, model: str, out: Path, py: Path, env_mod: Any
            ) -> dict[str, Any]:  # fmt: skip
    """TRL's ``GRPOTrainer`` in its venv on relayrl's prompts for steps 0..N-1, in order."""
    from relayrl.config import RunConfig, load_config
    from relayrl.data.prompts import PromptSource
    from relayrl.model import load_tokenizer

    cfg = load_config(RunConfig, Path(a.config), relayrl_overrides(a, seed, model, out / "x"))
    tok = load_tokenizer(cfg.model.path)
    src = PromptSource(cfg.data, tok, seed)
    prompts = [p for step in range(a.steps) for p in src.for_step(step, a.prompts)]
    assert cfg.model.lora is not None
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "model": cfg.model.path,
        "threads": a.threads,
        "config": trl_config(a, seed, out / "trl"),
        "prompts": trl_rows(prompts, tok),
        "reward": "reasoning_gym",
        "lora": lora_spec(cfg.model.lora),
        "save_merged": str(out / "merged"),
        "save_steps": [x for x in curves.eval_steps(a.steps, a.eval_every) if 0 < x < a.steps],
        "save_dir": str(out / "saved"),
        "result": str(out / "result.json"),
    }
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "bench")]))
    env["OMP_NUM_THREADS"] = str(a.threads)
    cmd = [str(py), str(env_mod.__file__), str(out / "spec.json")]
    if subprocess.run(cmd, env=env).returncode != 0:
        raise SystemExit(f"the TRL arm failed: {' '.join(cmd)}")
    res = json.loads((out / "result.json").read_text())
    res["model_out"] = spec["save_merged"]
    saved = {int(k): v for k, v in res.get("saved", {}).items()}
    res["saved"] = saved | {a.steps: res["model_out"]}
    logs = [r for r in res.get("log_history", []) if "reward" in r]
    res["reward_mean"] = [round(float(r["reward"]), 4) for r in logs]
    res["grad_norm"] = [round(float(r.get("grad_norm", float("nan"))), 4) for r in logs]
    return res


def shared_eval(a: argparse.Namespace, seed: int, model_dir: str, out: Path) -> float:
    """Greedy held-out accuracy of ``model_dir`` (a plain HF directory): ``relayrl eval`` of the
    recipe (adapters off, ``--eval-size`` held-out problems of ``seed``) in its own process."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "relayrl.cli", "eval", a.config, f"model.path={model_dir}",
           "model.lora=null", f"seed={seed}", f"data.eval_size={a.eval_size}",
           f"rollout.max_tokens={a.max_tokens}", f"threads={a.threads}",
           "--output", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS=str(a.threads))
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    return float(summary["held-out"]["pass_rate"])


def figures(arm: str, seed: int, res: dict[str, Any], accs: dict[int, float],
            a: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One arm's JSON line: accuracy before / after, the curve (``peer_trl_curves.curve``),
    the per-step medians and lists, weight change."""
    st, cpu, gen = res["step_times"], res.get("cpu_times") or [], res.get("gen_times") or []
    steps = curves.eval_steps(a.steps, a.eval_every)
    return {
        "bench": "peer_trl_smollm2", "arm": arm, "seed": seed, "steps": a.steps,
        "prompts": a.prompts, "group": a.group, "eval_size": a.eval_size,
        "eval_every": a.eval_every,
        "acc_before": round(accs[0], 4), "acc_after": round(accs[a.steps], 4),
        "curve": curves.curve(steps, st, cpu, accs),
        "s_per_step": median(st), "cpu_s_per_step": median(cpu), "gen_s_per_step": median(gen),
        "step_times": [round(x, 2) for x in st], "cpu_times": [round(x, 2) for x in cpu],
        "train_wall_s": round(res["wall_s"], 1),
        "reward_mean": res.get("reward_mean"), "grad_norm": res.get("grad_norm"),
        "weight_delta_l2": weight_delta(a.base_model, res["model_out"]),
        **({"own_eval": res["own_eval"]} if "own_eval" in res else {}),
        **({"trl_version": res["trl_version"]} if "trl_version" in res else {}),
    }  # fmt: skip


def weight_delta(base_dir: str, tuned_dir: str) -> float:
    """sqrt(sum over the base model's weights of ||W_tuned - W_base||^2): how far an arm moved
    the model (merged LoRA: the adapters' B @ A * alpha / r)."""
    from safetensors.torch import load_file

    base = load_file(str(Path(base_dir) / "model.safetensors"))
    tuned = load_file(str(Path(tuned_dir) / "model.safetensors"))
    total = 0.0
    for k, w in base.items():
        if k in tuned:
            total += float((tuned[k].double() - w.double()).pow(2).sum())
    return round(total**0.5, 5)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="held-out accuracy every K steps (0: before and after only)",
    )
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="the accuracy to time (default: the highest every arm reached)",
    )
    ap.add_argument("--lr", type=float, default=2e-4, help="the recipe's")
    ap.add_argument("--max-tokens", type=int, default=16, help="the recipe's")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--config", default=str(RECIPE))
    ap.add_argument("--vllm-python", default=str(VLLM_PY), help="the relayrl-vllm arm's python")
    ap.add_argument("--work", default=str(REPO / "bench_out" / "peer_trl_smollm2"))
    ap.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    a = ap.parse_args(argv)
    if a.group < 2:
        ap.error("--group must be >= 2 (group advantages)")
    if a.eval_every < 0:
        ap.error("--eval-every must be >= 0")
    return a


def run_arm(a: argparse.Namespace, arm: str, seed: int, model: str, out: Path, py: Path | None,
            env_mod: Any) -> dict[str, Any] | str:  # fmt: skip
    """One arm's training: its result, or (the vLLM arm) one line saying why there is none."""
    if arm == "trl":
        assert py is not None
        return run_trl(a, seed, model, out, py, env_mod)
    if arm == "relayrl-vllm":
        return run_relayrl_elsewhere(a, seed, model, out, arm, Path(a.vllm_python))
    return run_relayrl(a, seed, model, out, arm)


def seed_summary(a: argparse.Namespace, seed: int, rows: dict[str, dict[str, Any]],
                 load: list[float]) -> dict[str, Any]:  # fmt: skip
    """A seed's summary line: each arm's accuracy and per-step figures, the ratios to TRL, the
    common target and each arm's training time to it (``peer_trl_curves.target_summary``)."""
    line: dict[str, Any] = {"bench": "peer_trl_smollm2", "summary": True, "seed": seed,
                            "load_avg_start": load,
                            "load_avg_end": [round(x, 1) for x in os.getloadavg()]}  # fmt: skip
    for arm, r in rows.items():
        for k in ("acc_before", "acc_after", "s_per_step", "cpu_s_per_step"):
            line[f"{arm}_{k}"] = r[k]
    if "trl" in rows:
        keys = ("s_per_step", "cpu_s_per_step", "gen_s_per_step")
        for arm in rows:
            if arm != "trl":
                line |= ratios(rows[arm], rows["trl"], keys, name=arm)
    line |= curves.target_summary({arm: r["curve"] for arm, r in rows.items()}, a.target)
    return line


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2])
    a = parse(argv)
    env_mod = _env_module()
    work = Path(a.work).resolve()
    if a.dry_run:
        plan = {arm: relayrl_overrides(a, a.seeds[0], "smollm2", work / arm, arm)
                for arm in ARM_OVERRIDES if arm in a.arms}  # fmt: skip
        plan |= {"trl": trl_config(a, a.seeds[0], work / "trl"),
                 "eval_steps": curves.eval_steps(a.steps, a.eval_every),
                 "trl_env": env_mod.venv_plan(env_mod.VENV, env_mod.LOCK)}  # fmt: skip
        print(json.dumps({"bench": "peer_trl_smollm2", "plan": plan}, indent=1))
        return 0
    import torch

    from relayrl.model.fetch import fetch_model

    torch.set_num_threads(a.threads)
    py = env_mod.ensure_venv(env_mod.VENV, env_mod.LOCK) if "trl" in a.arms else None
    model = str(fetch_model("smollm2"))
    a.base_model = model
    summaries = []
    for seed in a.seeds:
        load = [round(x, 1) for x in os.getloadavg()]
        base = shared_eval(a, seed, model, work / f"eval_base_seed{seed}.jsonl")
        rows: dict[str, dict[str, Any]] = {}
        for arm in a.arms:
            out = work / f"{arm}_seed{seed}"
            shutil.rmtree(out, ignore_errors=True)
            res = run_arm(a, arm, seed, model, out, py, env_mod)
            if isinstance(res, str):  # no result: one line why, and on
                print(json.dumps({"bench": "peer_trl_smollm2", "arm": arm, "seed": seed,
                                  "skipped": res}), flush=True)  # fmt: skip
                continue
            accs = {0: base}  # step 0: the base model, the same for every arm
            for step, d in sorted(res["saved"].items()):
                if step in curves.eval_steps(a.steps, a.eval_every) and step > 0:
                    where = work / f"eval_{arm}_seed{seed}_step{step}.jsonl"
                    accs[step] = shared_eval(a, seed, d, where)
            rows[arm] = figures(arm, seed, res, accs, a)
            print(json.dumps(rows[arm]), flush=True)
        summaries.append(seed_summary(a, seed, rows, load))
        print(json.dumps(summaries[-1]), flush=True)
    if len(summaries) > 1:
        print(json.dumps({"bench": "peer_trl_smollm2", "summary": "seeds", "seeds": a.seeds,
                          **curves.across_seeds(summaries)}), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
