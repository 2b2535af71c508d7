"""The tinker-cookbook's arithmetic RL recipe, unmodified, against ``relayrl tinker-serve``.

Runs in its own environment, ``.bench-venv/cookbook`` (``--setup`` makes it): a venv that sees
the main venv's packages through a ``.pth`` file, with ``bench/peer_cookbook.lock`` installed
``--no-deps`` (tinker-cookbook 0.6.1 and what it needs beyond the main lock). The cookbook
declares ``tml-renderers>=0.4.1``, which the package registry does not have (0.2.1 is the
newest there); the cookbook imports it only for Thinking Machines' own tokenizers, so a Hugging
Face model directory runs without it (``pip check`` reports that one missing requirement).

Steps: build a tiny Llama with a character tokenizer; start ``relayrl tinker-serve`` on it
(its own process); warm it up through the SDK with ``cross_entropy`` on the recipe's own
rendering (the cookbook's ``role_colon`` renderer, the recipe's few-shot prefix, ``What is x +
y?`` -> the sum) and ``save_state``; then run ``python -m
tinker_cookbook.recipes.math_rl.train`` unchanged, configured by its command line only:
``model_name=<the model directory> renderer_name=role_colon base_url=<the service>
env=arithmetic loss_fn=importance_sampling load_checkpoint_path=<the warm-up checkpoint>``
(the recipe's default loss, ``stable_reinforce``, is one relayrl refuses). Prints one JSON
line: the recipe's per-step ``env/all/correct`` and ``env/all/reward/total``, its seconds per
step (``time/total``) and steps per second; then relayrl's own sync GRPO trainer on the same
task (the recipe's rendered prompts and answers), warm start, batch, lr and ``max_tokens``,
and a summary line with the ratio of their median seconds per step.

    .venv/bin/python bench/peer_cookbook.py --setup --steps 20  # makes the venv, reruns in it
"""

from __future__ import annotations

import argparse
import hashlib
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

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".bench-venv" / "cookbook"
LOCK = ROOT / "bench" / "peer_cookbook.lock"
MAIN_PY = ROOT / ".venv" / "bin" / "python"


MISSING = """
import importlib.metadata as m, re
for req in m.distribution("tinker_cookbook").requires or []:
    if "extra ==" in req and "math-rl" not in req:
        continue
    name = re.split(r"[<>=!;\\[ ]", req)[0]
    try:
        m.version(name)
    except m.PackageNotFoundError:
        if name != "tml-renderers":
            print(req.split(";")[0].replace(" ", ""))
"""
"""Run by the venv's python: the cookbook's requirements (its own and its math-rl extra's)
that nothing installs, but ``tml-renderers`` (see the module docstring)."""


def venv_ready(venv: Path = VENV, lock: Path = LOCK) -> bool:
    """Whether ``venv`` holds ``lock`` as it is now (its stamp is the lock's sha256)."""
    stamp = venv / ".installed"
    return stamp.exists() and stamp.read_text().strip() == _digest(lock)


def _digest(lock: Path) -> str:
    return hashlib.sha256(lock.read_bytes()).hexdigest()


def setup(main_python: Path, venv: Path = VENV, lock: Path = LOCK) -> Path:
    """Make the cookbook venv, or reuse it while its stamp matches the lock; its python.

    A venv without pip of its own whose site-packages sees ``main_python``'s through a ``.pth``
    file; the lock installed with that pip, ``--no-deps`` (the lock is the whole resolve), each
    pin checked, then the stamp (the lock's sha256) written: a changed lock rebuilds it."""
    py = venv / "bin" / "python"
    if venv_ready(venv, lock):
        return py
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([str(main_python), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(main_python), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    own = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(own, "main_venv.pth").write_text(site + "\n")
    pins = [x.split("#")[0].strip() for x in lock.read_text().splitlines()]
    pins = [x for x in pins if x]
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-deps", "-r", str(lock)], check=True)  # fmt: skip
    check = "import importlib.metadata as m, sys; print(*(m.version(n) for n in sys.argv[1:]))"
    names = [x.split("==")[0] for x in pins]
    got = subprocess.run([str(py), "-c", check, *names], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    for pin, version in zip(pins, got, strict=True):
        if pin.split("==")[1] != version:
            raise SystemExit(f"{venv}: {pin} pinned, {version} installed")
    missing = subprocess.run([str(py), "-c", MISSING], capture_output=True, text=True,
                             check=True).stdout.split()  # fmt: skip
    if missing:
        raise SystemExit(f"{venv}: tinker-cookbook needs {missing}: add them to {lock}")
    (venv / ".installed").write_text(_digest(lock) + "\n")
    return py


def start_service(model: Path, state: Path, python: str, seed: int = 0
                  ) -> tuple[subprocess.Popen[str], str]:  # fmt: skip
    """``relayrl tinker-serve`` on ``model`` in its own process (one torch thread); its URL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [python, "-m", "relayrl.cli", "tinker-serve", str(model), "--port", "0",
           "--state-dir", str(state), "--threads", "1", "--seed", str(seed)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if "relayrl tinker-serve: http://" in line:
            return proc, line.split()[2]
    raise RuntimeError(f"tinker-serve exited with {proc.wait()}")


def sft_lr(step: int, a: argparse.Namespace) -> float:
    """The warm-up's learning rate at ``step`` (0-based): linear warmup over
    ``--sft-warmup`` steps, then cosine decay from ``--sft-lr`` to ``--sft-lr`` / 10 at
    ``--sft-steps``: lr = lr_min + (lr - lr_min) (1 + cos(pi t)) / 2, t = step / sft_steps."""
    if step < a.sft_warmup:
        return float(a.sft_lr * (step + 1) / a.sft_warmup)
    t = min(step / max(a.sft_steps, 1), 1.0)
    low = a.sft_lr / 10
    return float(low + (a.sft_lr - low) * 0.5 * (1 + math.cos(math.pi * t)))


def recipe_correct(tc: Any, renderer: Any, problems: list[tuple[int, int]], a: argparse.Namespace,
                   name: str) -> float:  # fmt: skip
    """The fraction of samples the recipe would score correct: ``--group`` samples per
    problem at temperature 1 (the recipe's), its stop sequence and ``max_tokens``, each
    response parsed and checked as ``ArithmeticEnv.step`` does."""
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv

    sc = tc.save_weights_and_get_sampling_client(name).result()
    params = tinker.types.SamplingParams(max_tokens=a.max_tokens, temperature=1.0,
                                         stop=renderer.get_stop_sequences())  # fmt: skip
    prefix = ArithmeticEnv.standard_fewshot_prefix()
    futs = []
    for x, y in problems:
        msgs = [*prefix, {"role": "user", "content": f"What is {x} + {y}?"}]
        prompt = renderer.build_generation_prompt(msgs)
        futs.append((ArithmeticEnv(x, y, renderer), sc.sample(prompt, a.group, params)))
    ok = []
    for env, fut in futs:
        for seq in fut.result().sequences:
            message, _ = renderer.parse_response(seq.tokens)
            ok.append(env.check_answer(renderers.get_text_content(message)))
    return float(sum(ok) / len(ok))


def warm_up(url: str, model: Path, a: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """SFT through the SDK on the recipe's rendering: each datum a conversation of the
    few-shot prefix and ``--sft-pack`` questions with their answers (the first one at the
    place the recipe's own question takes; loss on every answer), ``sft_lr``'s schedule,
    evaluated every
    ``--sft-eval-every`` steps by ``recipe_correct`` on held-out problems and stopped once it
    reaches ``--sft-target``; the saved state's tinker:// path and the warm-up's figures."""
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from tinker_cookbook.supervised.common import datum_from_model_input_weights
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    tok = get_tokenizer(str(model))
    renderer = renderers.get_renderer("role_colon", tok)
    client = tinker.ServiceClient(base_url=url, api_key="tml-cookbook")
    tc = client.create_lora_training_client(base_model=str(model), rank=a.rank).result()
    rng = random.Random(a.seed)
    draw = random.Random(a.seed + 10_000)
    held = [(draw.randint(0, a.max_operand), draw.randint(0, a.max_operand))
            for _ in range(a.sft_eval_size)]  # fmt: skip
    prefix = ArithmeticEnv.standard_fewshot_prefix()
    every = renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES  # the few-shot "9" too
    losses, evals, t0 = [], {}, time.perf_counter()
    for step in range(a.sft_steps):
        data, weight = [], 0.0
        while len(data) < a.sft_batch:
            msgs = [*prefix]
            while len(msgs) < len(prefix) + 2 * a.sft_pack:
                x, y = rng.randint(0, a.max_operand), rng.randint(0, a.max_operand)
                if (x, y) not in held:
                    msgs += [{"role": "user", "content": f"What is {x} + {y}?"},
                             {"role": "assistant", "content": str(x + y)}]  # fmt: skip
            model_input, weights = renderer.build_supervised_example(msgs, every)
            data.append(datum_from_model_input_weights(model_input, weights))
            weight += float(weights.sum())
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(tinker.types.AdamParams(learning_rate=sft_lr(step, a))).result()
        losses.append(fb.result().metrics["loss:sum"] / weight)
        done = step + 1
        if a.sft_eval_every and (done % a.sft_eval_every == 0 or done == a.sft_steps):
            evals[done] = recipe_correct(tc, renderer, held, a, f"eval{done}")
            print(f"warm-up step {done}: loss {losses[-1]:.4f}, correct {evals[done]:.3f}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if a.sft_target and evals[done] >= a.sft_target:
                break
    info = {"warm_up_steps": len(losses), "warm_up_s": round(time.perf_counter() - t0, 1),
            "warm_up_loss_first": round(losses[0], 4), "warm_up_loss_last": round(losses[-1], 4),
            "warm_up_correct": evals}  # fmt: skip
    print(json.dumps(info), flush=True)
    tc.save_weights_for_sampler("warm").result()  # a HF directory for relayrl's own trainer
    return tc.save_state("warm").result().path, info


def run_relayrl(model: Path, hf_dir: Path, out: Path, a: argparse.Namespace) -> dict:
    """relayrl's own sync GRPO trainer on the recipe's task: the same rendered prompts (the
    few-shot ``role_colon`` text, special tokens dropped), answers, warm start, batch, lr and
    ``max_tokens`` (no stop string: completions run to the EOS or the cap)."""
    import numpy as np
    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    from relayrl.cluster.local import build_local_roles
    from relayrl.config import RunConfig, load_config
    from relayrl.controller.trainer import train

    tok = get_tokenizer(str(model))
    renderer = renderers.get_renderer("role_colon", tok)
    rng = np.random.RandomState(a.seed)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "prompts.jsonl", "w") as f:
        for _ in range(a.groups * a.steps + 400):
            x, y = int(rng.randint(0, 101)), int(rng.randint(0, 101))
            msgs = [*ArithmeticEnv.standard_fewshot_prefix(),
                    {"role": "user", "content": f"What is {x} + {y}?"}]  # fmt: skip
            ids = renderer.build_generation_prompt(msgs).to_ints()
            text = tok.decode(ids, skip_special_tokens=True)
            f.write(json.dumps({"prompt": text, "answer": str(x + y)}) + "\n")
    cfg = load_config(
        RunConfig,
        None,
        [
            f"model.path={hf_dir}", f"run_dir={out / 'run'}", f"seed={a.seed}",
            "data.task=jsonl", f"data.train_path={out / 'prompts.jsonl'}", "data.eval_size=100",
            "logging.progress=false", "logging.tensorboard=false", f"train.steps={a.steps}",
            f"algo.prompts_per_step={a.groups}", f"algo.group_size={a.group}",
            "algo.kl_coef=0.0", "algo.mini_batches=1", f"optim.lr={a.lr}",
            "optim.warmup_steps=0", f"rollout.max_tokens={a.max_tokens}",
            "rollout.temperature=1.0", "threads=1",
        ],
    )  # fmt: skip
    train(cfg, lambda actor, critic: build_local_roles(cfg, actor, critic))
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    step_s = [float(r["time/step"]) for r in rows if "time/step" in r]
    return {
        "arm": "relayrl_trainer",
        "reward": [round(float(r["reward_mean"]), 4) for r in rows if "reward_mean" in r],
        "s_per_step": [round(x, 3) for x in step_s],
        "steps_per_s": len(step_s) / sum(step_s),
    }


def run_recipe(url: str, model: Path, ckpt: str, log: Path, a: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train",
        f"model_name={model}", "renderer_name=role_colon", f"base_url={url}",
        "env=arithmetic", "loss_fn=importance_sampling", f"load_checkpoint_path={ckpt}",
        f"group_size={a.group}", f"groups_per_batch={a.groups}", f"max_steps={a.steps}",
        f"learning_rate={a.lr}", f"max_tokens={a.max_tokens}", f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
        "eval_every=0", "save_every=0",
    ]  # fmt: skip
    env = {**os.environ, "TINKER_API_KEY": "tml-cookbook", "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t
    rows = [json.loads(x) for x in (log / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "env/all/correct" in r]
    step_s = [float(r["time/total"]) for r in rows]
    return {
        "recipe": "tinker_cookbook.recipes.math_rl.train env=arithmetic",
        "steps": len(rows),
        "correct": [round(float(r["env/all/correct"]), 4) for r in rows],
        "reward": [round(float(r["env/all/reward/total"]), 4) for r in rows],
        "format": [round(float(r["env/all/format"]), 4) for r in rows],
        "kl_sample_train_max": max(abs(float(r["optim/kl_sample_train_v1"])) for r in rows),
        "s_per_step": [round(s, 3) for s in step_s],
        "steps_per_s": len(step_s) / sum(step_s),
        "wall_s": wall,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--setup",
        action="store_true",
        help="make (or reuse) the venv and rerun in it: what any other python does",
    )
    p.add_argument("--setup-only", action="store_true", help="make (or reuse) the venv, exit")
    p.add_argument("--venv", default=str(VENV), help="the cookbook venv")
    p.add_argument(
        "--main-python",
        default=str(MAIN_PY if MAIN_PY.exists() else sys.executable),
        help="the python whose packages the venv sees (the main venv's)",
    )
    p.add_argument(
        "--arms",
        nargs="+",
        default=["recipe", "relayrl"],
        choices=["recipe", "relayrl"],
        help="relayrl: also relayrl's own trainer",
    )
    p.add_argument("--out", default=str(ROOT / "bench_out" / "cookbook"))
    p.add_argument("--hidden", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rank", type=int, default=0, help="LoRA rank (0: full parameters)")
    p.add_argument("--max-operand", type=int, default=100, help="the recipe draws 0..100")
    p.add_argument("--sft-steps", type=int, default=1500, help="at most (--sft-target)")
    p.add_argument("--sft-batch", type=int, default=32)
    p.add_argument("--sft-pack", type=int, default=6, help="questions per SFT datum")
    p.add_argument(
        "--warm-start",
        default="",
        help="a tinker:// state in --out's state dir from an earlier run: no warm-up",
    )
    p.add_argument("--model-seed", type=int, default=None, help="the tiny model's init (--seed)")
    p.add_argument("--sft-lr", type=float, default=3e-3, help="peak, after --sft-warmup")
    p.add_argument("--sft-warmup", type=int, default=50, help="linear warmup steps")
    p.add_argument("--sft-eval-every", type=int, default=100, help="0: no evaluation")
    p.add_argument("--sft-eval-size", type=int, default=64, help="held-out problems")
    p.add_argument(
        "--sft-target",
        type=float,
        default=0.25,
        help="stop once the held-out correct rate reaches this (0: never)",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-tokens", type=int, default=16,
                   help="the recipe's 5 assumes BPE: a character tokenizer needs room for the "
                   "answer and the 7-character stop sequence '\\n\\nUser:'")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--first-last", type=int, default=5, help="steps averaged at each end")
    return p.parse_args(argv)


def curve_summary(correct: list[float], k: int) -> dict[str, Any]:
    """The recipe's ``env/all/correct`` curve in short: the means of its first and last ``k``
    steps and their difference (the rise)."""
    k = max(1, min(k, len(correct) // 2 or 1))
    first, last = sum(correct[:k]) / k, sum(correct[-k:]) / k
    return {"k": k, "correct_first": round(first, 4), "correct_last": round(last, 4),
            "rise": round(last - first, 4)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if Path(sys.prefix).resolve() != Path(a.venv).resolve():
        py = setup(Path(a.main_python), Path(a.venv))
        if a.setup_only:
            return 0
        return subprocess.run([str(py), __file__, *(argv or sys.argv[1:])]).returncode
    sys.path.insert(0, str(ROOT / "src"))
    import numpy as np

    from relayrl.model import build_tiny_model

    out = Path(a.out)
    init = a.seed if a.model_seed is None else a.model_seed
    model = build_tiny_model(out / "base", hidden_size=a.hidden, num_layers=a.layers,
                             max_position_embeddings=512, seed=init)  # fmt: skip
    proc, url = start_service(model, out / "state", sys.executable, a.seed)
    try:
        if a.warm_start:
            ckpt, info = a.warm_start, {"warm_start": a.warm_start}
        else:
            ckpt, info = warm_up(url, model, a)
        res: dict[str, Any] = run_recipe(url, model, ckpt, out / "recipe", a)
    finally:
        proc.terminate()
        proc.wait(30)
    res |= curve_summary(res["correct"], a.first_last)
    res["s_per_step_median"] = float(np.median(res["s_per_step"]))
    print(json.dumps(res), flush=True)
    summary = {"summary": "peer_cookbook", "seed": a.seed, **info,
               **{k: res[k] for k in ("correct_first", "correct_last", "rise", "k")},
               "recipe_s_per_step_median": res["s_per_step_median"]}  # fmt: skip
    if "relayrl" in a.arms:
        model_id = ckpt[len("tinker://") :].split("/")[0]
        hf_dir = out / "state" / model_id / "sampler_weights" / "warm"
        own = run_relayrl(model, hf_dir, out / "relayrl", a)
        print(json.dumps(own), flush=True)
        summary["relayrl_s_per_step_median"] = float(np.median(own["s_per_step"]))
        summary["ratio"] = res["s_per_step_median"] / summary["relayrl_s_per_step_median"]
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
