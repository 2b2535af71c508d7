"""The prepared GPU run (tools/device_run.py) and what surrounds it, checked on the CPU.

The run's steps go through the same code on the CPU (tiny models) and must all pass; without
CUDA, ``--device cuda`` and ``make gpu-check`` fail with one line; the device kit covers what
relayrl needs on an image without pydantic, datasets, fastapi, uvicorn, openai, ray or vllm;
the committed GPU runs name their device and every step's outcome; the planner's measured H200
figures are the committed run's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
CPU_STEPS = "env,peaks,engine,ipc,fsdp,nccl_pair,update_0.5b,decode"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")


def test_device_run_steps_pass_on_cpu(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "device_run.py"), "--device", "cpu"]
    cmd += ["--out", str(tmp_path), "--only", CPU_STEPS]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    res = json.loads((tmp_path / "device_run.json").read_text())
    failed = {k: s.get("error") for k, s in res["steps"].items() if not s["ok"]}
    assert out.returncode == 0 and not failed, (failed, out.stdout[-3000:], out.stderr[-3000:])
    steps = res["steps"]
    assert set(steps) == set(CPU_STEPS.split(","))
    assert res["device"]["device"] == "cpu"
    assert steps["engine"]["master_dtypes"] == ["torch.float32"]
    assert steps["engine"]["engine_dtype"] == "torch.bfloat16"
    assert steps["ipc"]["worker_pid"] != steps["ipc"]["parent_pid"]
    assert steps["ipc"]["greedy_equal_after_update"]
    assert steps["ipc"]["versions_after_update"] == [1]
    assert steps["fsdp"]["resume_bit_exact"] and steps["fsdp"]["sharded"]
    assert steps["fsdp"]["lora_ref_unchanged"]
    for ac in ("ac", "no_ac"):
        assert steps["update_0.5b"][ac]["tokens_per_s"] > 0
        assert steps["update_0.5b"][ac]["predicted_peak_gib"] > 0
    assert steps["decode"]["rows_1"]["engine_tokens_per_s"] > 0


def test_device_run_hot_path_step_on_cpu(tmp_path):
    """The ``hot_path`` step (tools/device_hot_path.py) as the GPU run will run it: one host
    read of floating-point values in an update of 4 forwards and 2 optimizer steps (AdamW's
    own reads of its host step counters set apart, and seen), a colocated engine's weights
    loaded with no copy off the device and equal to the actor's, the counters' self-checks."""
    cmd = [sys.executable, str(ROOT / "tools" / "device_run.py"), "--device", "cpu"]
    cmd += ["--out", str(tmp_path), "--only", "hot_path"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=600)
    res = json.loads((tmp_path / "device_run.json").read_text())
    step = res["steps"]["hot_path"]
    assert out.returncode == 0 and step["ok"], (step, out.stdout[-3000:], out.stderr[-3000:])
    assert (step["update_forwards"], step["optimizer_steps"]) == (4, 2)
    assert step["update_host_syncs"] == 1
    # the metrics' one transfer: ActorWorker.update's host_floats (algos/masked.py)
    sites = step["update_host_sync_sites"]
    assert sum(sites.values()) == 1 and all(k.startswith("algos/masked.py:") for k in sites)
    assert step["critic_update_host_syncs"] == 1
    assert step["batch_d2h_copies"] == {"compute_logprobs": 0, "compute_values": 0}  # CPU
    assert list(step["critic_update_host_sync_sites"]) == list(sites)  # the same host_floats
    assert step["update_host_reads_any_dtype"] >= 1
    assert step["update_mask_reads"] == 0  # padded micro-batches: the 4D mask, no check read
    assert step["optimizer_step_host_reads"] > 0  # the CPU's step counters, not in the figure
    assert step["optimizer"]["class"] == "AdamW" and step["optimizer"]["capturable"] is False
    assert step["optimizer"]["step_counter_devices"] == ["cpu"]
    assert step["weight_sync_d2h_copies"] == 0 and step["weight_sync_cross_device_copies"] == {}
    assert step["weight_sync_host_syncs"] == 0
    assert step["engine_weights_equal_actor"] and step["engine_dtype"] == "torch.bfloat16"
    assert step["self_checks"] == {"host_reads_item": True, "copies_off_device": True}
    assert step["update_cuda_sync_calls"] is None  # CUDA only


@no_cuda
@pytest.mark.parametrize("tool", ["device_run.py", "gpu_check.py"])
def test_without_cuda_the_gpu_tools_refuse_in_one_line(tool):
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / tool)],  # default: --device cuda
        capture_output=True,
        text=True,
        env=ENV,
        timeout=120,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0], out.stderr
    assert '"ok": true' not in out.stdout


def _kit_packages() -> list[str]:
    text = (ROOT / "Makefile").read_text()
    return re.search(r"^KIT_PKGS := (.+)$", text, re.M).group(1).split()  # type: ignore[union-attr]


def test_device_kit_packages_are_pinned_in_the_lock():
    lock = (ROOT / "requirements.lock").read_text().lower()
    for pkg in _kit_packages():
        assert re.search(rf"^{re.escape(pkg.lower())}==\S+$", lock, re.M), pkg


# what the GPU image lacks and the kit does not bring: relayrl's GPU paths must not import it
ABSENT_ON_IMAGE = ["datasets", "fastapi", "uvicorn", "openai", "ray", "vllm"]
GPU_PATH_MODULES = [
    "relayrl.cli",
    "relayrl.demo",
    "relayrl.config",
    "relayrl.workers.build",
    "relayrl.workers.fsdp",
    "relayrl.rollout",
    "relayrl.cluster.engine_process",
    "relayrl.cluster.weight_collective",
    "relayrl.cluster.local",
    "relayrl.controller.trainer",
    "relayrl.plan.memory",
]


def test_gpu_paths_import_without_what_the_image_lacks():
    code = f"""
import sys, importlib.abc
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {ABSENT_ON_IMAGE!r}:
            raise ImportError('absent on the GPU image: ' + name)
sys.meta_path.insert(0, Block())
for m in {GPU_PATH_MODULES!r}:
    __import__(m)
print('ok')
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


RUNS = sorted((ROOT / "docs" / "gpu-runs").glob("*.json"))


@pytest.mark.parametrize("path", RUNS, ids=[p.name for p in RUNS])
def test_recorded_gpu_runs_name_their_device_and_every_step(path):
    res = json.loads(path.read_text())
    dev = res["device"]
    assert dev["device"] == "cuda" and dev["gpu"] and dev["torch"] and dev["cuda"]
    assert res["steps"]
    for name, step in res["steps"].items():
        assert isinstance(step["ok"], bool), name
        if not step["ok"]:  # a failing step says why
            assert step.get("error") or step.get("errors"), name


def test_planner_h200_measured_is_the_recorded_run():
    from relayrl.plan.hardware import MEASURED, get_hardware

    m = MEASURED["h200-measured"]
    res = json.loads((ROOT / m.source).read_text())
    peaks = res["steps"]["peaks"]
    hw = get_hardware("h200-measured")
    assert hw.peak_flops == pytest.approx(peaks["matmul_tflops"] * 1e12, rel=1e-3)
    assert hw.mem_bandwidth == pytest.approx(peaks["copy_tb_per_s"] * 1e12, rel=1e-3)
    assert m.mfu == res["steps"]["update_1.5b"]["no_ac"]["mfu"]
    decode = json.loads((ROOT / m.decode_source).read_text())["steps"]["decode"]
    assert m.decode_step_overhead_s == pytest.approx(
        1 / decode["rows_1"]["graphs"]["engine_decode_tokens_per_s"]
    )
    assert m.roofline_fraction == decode["rows_256"]["graphs"]["roofline_fraction"]
    assert m.weight_load_s_per_gb == decode["weight_load_s_per_gb"]
    assert get_hardware("h200").peak_flops == 989e12  # the datasheet entry stays


def test_planner_uses_the_measured_figures_by_default():
    import argparse

    from relayrl.plan.cli import _time_model, _with_efficiencies
    from relayrl.plan.hardware import MEASURED

    seen = {}
    run = _with_efficiencies(lambda a: seen.update(vars(a)))
    run(argparse.Namespace(hardware="h200-measured", mfu=None, decode_eff=None))
    assert seen["mfu"] == MEASURED["h200-measured"].mfu and seen["decode_eff"] == 0.6
    run(argparse.Namespace(hardware="h200", mfu=None, decode_eff=None))
    assert seen["mfu"] == 0.4
    run(argparse.Namespace(hardware="h200-measured", mfu=0.5, decode_eff=0.7))
    assert (seen["mfu"], seen["decode_eff"]) == (0.5, 0.7)  # given values win
    tm = _time_model(
        argparse.Namespace(
            model="qwen2.5-0.5b", hardware="h200-measured", mfu=0.3, decode_eff=0.6, profile=None
        )
    )
    assert tm.step_overhead_s == MEASURED["h200-measured"].decode_step_overhead_s
