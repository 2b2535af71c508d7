"""Overlap and async (AReaL) schedules on the tiny model, with the engine in its own process."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import threading
import time

import pytest
import torch

from helpers import run_config
from relayrl.cluster.engine_process import RolloutWorkerDied
from relayrl.cluster.local import build_local_roles
from relayrl.controller.algorithms import make_requests
from relayrl.controller.checkpoint import latest_checkpoint
from relayrl.controller.trainer import train
from relayrl.data.prompts import PromptSource
from relayrl.workers import ActorWorker, Experience


def _train(cfg, resume=False):
    return train(cfg, lambda a, c: build_local_roles(cfg, a, c), resume=resume)


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "schedule,extra",
    [
        ("overlap", ["train.steps=50"]),
        ("async", ["train.steps=120", "async.eta=2", "async.interrupt=true"]),
    ],
)
@pytest.mark.learning
def test_schedule_raises_held_out_pass_rate(sft_model, tmp_path, schedule, extra, outcome):
    """Off-policy GRPO still learns. lr 3e-4: at the default 5e-4 the held-out gain over seeds
    0-4 was 0.105 / 0.185 (overlap, min / median) and -0.01 / 0.15 (async eta 2, 50 steps).
    Measured with this config over seeds 0-4 (min / median), with a second run of the suite
    beside it: overlap 50 steps 0.125 / 0.245; async 80 steps 0.135 / 0.295 (at 50 steps seed
    2 gained only 0.025-0.05 over three runs); seed 0 with other CPU kernels under load:
    overlap 0.125 (avx2) / 0.115 (default), async 0.105 / 0.105. On an Intel AVX-512 CPU
    under default kernels seed 0's fixture starts where the held-out rate rises slowly: +0.035
    / +0.045 (overlap 50 and 80 steps, lr 3e-4 / 2e-4), +0.005 / +0.04 / +0.045 (async 80 and
    120 steps), while the training reward (mean of the last fifth of the steps minus the
    first fifth) rose +0.071 to +0.099 in those runs (seed 1 there: +0.19 held out). So the
    test runs async for 120 steps (its 80-step run stayed at +0.005 there, twice) and asserts
    both, below the worst of those: held out >= +0.025 and training reward >= +0.04."""
    cfg = run_config(
        sft_model,
        tmp_path / schedule,
        f"schedule={schedule}",
        "optim.lr=3e-4",
        "data.eval_size=200",
        *extra,
    )
    out = _train(cfg)
    outcome(before=out["eval_before"], after=out["eval_after"])
    rows = [r for r in _metrics(tmp_path / schedule) if "reward_mean" in r]
    fifth = max(1, len(rows) // 5)
    first, last = (
        sum(r["reward_mean"] for r in rs) / fifth for rs in (rows[:fifth], rows[-fifth:])
    )
    outcome(reward_first=first, reward_last=last)
    assert last >= first + 0.04, (first, last)
    assert out["eval_after"] >= out["eval_before"] + 0.025, out
    eta = 1 if schedule == "overlap" else 2
    assert max(r["staleness_max"] for r in rows) <= eta
    assert max(r["staleness_max"] for r in rows) >= 1  # data really was off-policy
    for key in ("trainer_idle_frac", "engine_slot_utilisation", "interrupted_frac"):
        assert key in rows[-1]
    assert sum(out["staleness_hist"].values()) > 0
    trace = json.loads((tmp_path / schedule / "timeline.json").read_text())
    roles = {e["cat"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"rollout", "trainer", "reward"} <= roles


def test_async_dynamic_sampling_trains_only_groups_with_signal(sft_model, tmp_path):
    """DAPO in async: groups whose answers all scored the same are dropped as they finish
    and replaced under the gate; every trained group then has a non-zero advantage, and
    in-order consumption still bounds every token's staleness by eta. A resumed run goes on
    from the checkpoint's admission id, past the dropped groups: no prompt is trained twice."""
    run_dir = tmp_path / "ds"
    common = [
        "schedule=async",
        "async.eta=1",
        "train.save_every=4",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "data.eval_size=8",
        "data.dynamic_sampling.enabled=true",
        "data.dynamic_sampling.max_rounds=8",
    ]
    _train(run_config(sft_model, run_dir, "train.steps=4", *common))
    rows = [r for r in _metrics(run_dir) if "reward_mean" in r]
    assert len(rows) == 4
    assert any(r["dynamic/dropped_frac"] > 0 for r in rows)  # groups without signal were dropped
    assert all(r["actor/zero_adv_skipped_frac"] == 0.0 for r in rows)  # none was trained
    assert max(r["staleness_max"] for r in rows) <= 1
    # each step trains the next 8 groups in admission order, past the dropped ones
    assert rows[-1]["next_group"] > 4 * 8
    state = torch.load(latest_checkpoint(run_dir) / "trainer_state.pt", weights_only=False)
    assert state["schedule"]["next_group"] == rows[-1]["next_group"]

    _train(run_config(sft_model, run_dir, "train.steps=6", *common), resume=True)
    rows = [r for r in _metrics(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    starts = [r["next_group"] for r in rows]
    assert all(b >= a + 8 for a, b in itertools.pairwise(starts)), starts  # none trained twice
    assert max(r["staleness_max"] for r in rows) <= 1


def test_finish_order_resume_trains_no_admission_id_twice(tmp_path, monkeypatch):
    """``async.in_order: false`` with a forced straggler: group 1's reward takes 30 s, so step 1
    trains four later groups and the checkpoint holds next_group 1 and the ids trained above
    it. The resumed run generates group 1 again, passes over those ids, and across both runs
    no admission id is trained twice (they used to be: next_group went backwards). The resumed
    run scores without the delay, so group 1 is trained in it."""
    from relayrl.controller.buffer import GroupBuffer
    from relayrl.model import build_tiny_model, load_tokenizer

    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    run = tmp_path / "fo"
    b = 4
    first = run_config(model, run, "algo.prompts_per_step=4", "algo.group_size=2")
    straggler = PromptSource(first.data, load_tokenizer(model), first.seed).for_step(0, b)[1]
    common = lambda delay: [  # noqa: E731
        "schedule=async",
        "async.in_order=false",
        "async.eta=2",
        f"algo.prompts_per_step={b}",
        "algo.group_size=2",
        "algo.mini_batches=1",
        "rollout.max_tokens=4",
        "data.eval_size=4",
        "reward.service.num_workers=2",
        "reward.service.functions=[{fn: 'helpers:slow_on_prompt', kwargs: "
        f"{{slow: {json.dumps(straggler.record.prompt)}, delay_s: {delay}}}}}]",
    ]
    trained: list[list[int]] = []
    take = GroupBuffer.take

    def recording_take(self, n, *args, **kwargs):
        out = take(self, n, *args, **kwargs)
        trained.append([g.admission_index for g in out])
        return out

    monkeypatch.setattr(GroupBuffer, "take", recording_take)
    _train(run_config(model, run, "train.steps=1", *common(30.0)))
    assert 1 not in trained[0], trained  # the straggler was passed over
    state = torch.load(latest_checkpoint(run) / "trainer_state.pt", weights_only=False)
    assert state["schedule"]["next_group"] == 1
    assert state["schedule"]["trained_above"] == sorted(i for i in trained[0] if i > 1)
    _train(run_config(model, run, "train.steps=3", *common(0.0)), resume=True)
    ids = [i for step in trained for i in step]
    assert len(ids) == len(set(ids)) == 3 * b, trained
    assert 1 in ids


def test_eta_zero_reproduces_sync_semantics(sft_model, tmp_path):
    """eta = 0 on separate workers: every token is generated by the current policy."""
    common = [
        "train.steps=4",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "data.eval_size=8",
        "algo.policy_loss=ppo",
    ]
    _train(run_config(sft_model, tmp_path / "sync", *common))
    _train(run_config(sft_model, tmp_path / "eta0", "schedule=async", "async.eta=0", *common))
    sync = [r for r in _metrics(tmp_path / "sync") if "reward_mean" in r]
    eta0 = [r for r in _metrics(tmp_path / "eta0") if "reward_mean" in r]
    assert all(r["staleness_max"] == 0 for r in eta0)
    # same prompts, same per-request seeds, same weights at each step: same batches
    for a, b in zip(sync, eta0, strict=True):
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)
        assert a["response_length_mean"] == pytest.approx(b["response_length_mean"], abs=1e-6)


def test_decoupled_equals_ppo_on_fresh_data(sft_model, tmp_path):
    """With prox = behav (fresh data, one epoch) the decoupled update is the plain PPO update."""
    cfg = run_config(sft_model, tmp_path / "d", "algo.prompts_per_step=4", "algo.group_size=4")
    roles = build_local_roles(cfg, str(sft_model), None)
    prompts = PromptSource(cfg.data, roles.tokenizer, 0).for_step(0, 4)
    samples = roles.rollout.generate(make_requests(prompts, cfg, 0, [roles.tokenizer.eos_token_id]))
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    exp.old_logprobs = roles.actor.compute_logprobs(exp)
    exp.behaviour_logprobs = exp.old_logprobs.clone()  # fresh: behav == prox
    exp.advantages = torch.randn(
        exp.response_mask.shape, generator=torch.Generator().manual_seed(0)
    )
    import copy

    results = {}
    for loss in ("ppo", "decoupled_ppo"):
        actor = ActorWorker(
            copy.deepcopy(roles.actor.model),
            cfg.algo,
            cfg.optim,
            cfg.rollout.max_tokens,
            seed=0,
            policy_loss=loss,
        )
        stats = actor.update(exp)
        results[loss] = (stats, actor.model.state_dict())
    assert results["ppo"][0]["actor/loss"] == pytest.approx(
        results["decoupled_ppo"][0]["actor/loss"], abs=1e-9
    )
    for k, v in results["ppo"][1].items():
        torch.testing.assert_close(v, results["decoupled_ppo"][1][k], atol=1e-7, rtol=0)


def test_killed_engine_worker_is_a_clear_error_and_resume_continues(sft_model, tmp_path):
    run = tmp_path / "kill"
    common = [
        "schedule=async",
        "async.eta=1",
        "train.save_every=2",
        "algo.prompts_per_step=8",
        "algo.group_size=4",
        "data.eval_size=8",
    ]
    cfg = run_config(sft_model, run, "train.steps=200", *common)

    def killer():
        deadline = time.time() + 120
        while time.time() < deadline:
            if latest_checkpoint(run) is not None:
                for child in multiprocessing.active_children():
                    if child.name == "relayrl-rollout":
                        child.kill()
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    with pytest.raises(RolloutWorkerDied, match=r"died with exit code -9"):
        _train(cfg)
    t.join()
    ckpt = latest_checkpoint(run)
    assert ckpt is not None
    done = int(ckpt.name.split("_")[1])
    resumed = run_config(sft_model, run, f"train.steps={done + 4}", *common)
    _train(resumed, resume=True)
    rows = [r for r in _metrics(run) if "reward_mean" in r]
    steps = [r["step"] for r in rows]
    assert steps == sorted(set(steps)) and steps[-1] == done + 4  # no step logged twice
    after = [r for r in rows if r["step"] > done]
    assert len(after) == 4
    assert all(0 <= r["staleness_max"] <= 1 for r in after)  # versions re-based on resume
    assert after[0]["groups_admitted"] >= (done + 1) * 8


def test_send_racing_the_workers_exit_names_its_exit_code():
    """The race a CI run hit: the worker was killed, the next command met its closed pipe
    while the process table still showed it alive. The client waits for the exit and raises
    RolloutWorkerDied with the exit code, not a bare BrokenPipeError. (A real process cannot
    hit this window on demand; the kill-and-resume test above covers the real worker.)"""
    from relayrl.cluster.engine_process import EngineProcess

    class ExitingProcess:  # dead, but only visible once someone waits for it
        pid, exitcode, _reaped = 4242, -9, False

        def is_alive(self) -> bool:
            return not self._reaped

        def join(self, timeout: float | None = None) -> None:
            self._reaped = True

    class ClosedPipe:
        def send(self, msg: object) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    client = EngineProcess.__new__(EngineProcess)
    client._dead, client._stopping = None, False
    client._send_lock = threading.Lock()
    client._cmd_send, client.process = ClosedPipe(), ExitingProcess()
    with pytest.raises(RolloutWorkerDied, match=r"pid 4242\) died with exit code -9"):
        client.submit_many([])


def test_engine_worker_hurries_the_groups_it_is_told(sft_model):
    """``prioritize`` through the worker process: the urgent group's rows also decode alone
    (``urgent_steps`` of them per full step), so with equal budgets it finishes first."""
    from relayrl.cluster.engine_process import EngineProcess, EngineSpec
    from relayrl.model import load_causal_lm, load_tokenizer
    from relayrl.rollout import GenerationRequest, SamplingParams

    tok = load_tokenizer(sft_model)
    spec = EngineSpec(
        model_path=str(sft_model),
        dtype="float32",
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        max_slots=16,
        threads=1,
        version=0,
        urgent_steps=3,
    )
    with EngineProcess(spec, load_causal_lm(sft_model, torch.float32).state_dict()) as engine:
        engine.prioritize([1])  # before the requests: it applies to whatever of group 1 runs
        params = SamplingParams(max_tokens=40, ignore_eos=True, seed=0)
        engine.submit_many(
            GenerationRequest([5, 6, 7], params, group_id=int(i >= 6)) for i in range(8)
        )
        order: list[int] = []
        deadline = time.monotonic() + 60
        while len(order) < 8 and time.monotonic() < deadline:
            order += [s.group_id for s in engine.poll(timeout=0.5)]
        assert sorted(order) == [0] * 6 + [1] * 2
        assert order[:2] == [1, 1]  # 40 tokens in ~40 steps; the others needed ~4x as many
        assert engine.report().counters["urgent_steps"] > 0


def test_trained_tokens_carry_the_weights_that_generated_them(tmp_path, monkeypatch):
    """async eta 2 with interrupts, 64-token answers and weights that move every step: in each
    trained batch every token's version is the one the engine reported, at most eta behind the
    trainer, and its behaviour logprob is the logprob under that version's weights (so an
    interrupted sequence changed weights exactly where its versions change);
    ``interrupted_frac`` is the fraction of the batch's samples an update interrupted (it was
    the run's cumulative ratio over every sample received, trained or not)."""
    import copy

    from relayrl.controller.buffer import GroupBuffer
    from relayrl.controller.schedules import AsyncSchedule
    from relayrl.model import build_tiny_model

    model = build_tiny_model(tmp_path / "m", hidden_size=16)
    cfg = run_config(
        model,
        tmp_path / "run",
        "schedule=async",
        "async.eta=2",
        "async.interrupt=true",
        "train.steps=5",
        "algo.prompts_per_step=4",
        "algo.group_size=2",
        "rollout.max_tokens=64",
        "data.eval_size=4",
        "reward.fn=helpers:completion_parity",
        "optim.lr=1e-2",
    )
    weights: dict[int, dict] = {}  # version -> the actor's weights
    start, sync = AsyncSchedule.start, AsyncSchedule.sync_weights

    def recording_start(self, step, state=None):
        weights[step] = copy.deepcopy(self.roles.actor.model.state_dict())
        start(self, step, state)

    def recording_sync(self, step, trained):
        weights[step + 1] = copy.deepcopy(self.roles.actor.model.state_dict())
        return sync(self, step, trained)

    taken: list[list] = []
    take = GroupBuffer.take

    def recording_take(self, n, *args, **kwargs):
        out = take(self, n, *args, **kwargs)
        taken.append([s for g in out for s in g.samples])
        return out

    checked: list[tuple[int, float]] = []  # (staleness, max |behav - current logprob|)
    update = ActorWorker.update

    def checking_update(self, exp):
        step, samples = len(taken) - 1, taken[-1]
        mask = exp.response_mask > 0
        for i, s in enumerate(samples):  # no failures: the batch holds the taken samples
            n = len(s.response_ids)
            assert exp.versions[i, :n].tolist() == s.versions
        assert int((step - exp.versions)[mask].max()) <= 2
        now = copy.deepcopy(self.model.state_dict())
        current = self.compute_logprobs(exp)
        for v in set(exp.versions[mask].tolist()):
            self.model.load_state_dict(weights[v])
            at_v = self.compute_logprobs(exp)
            sel = mask & (exp.versions == v)
            gap = (at_v - exp.behaviour_logprobs)[sel].abs().max()
            assert float(gap) < 1e-4, (step, v, float(gap))
            moved = (current - exp.behaviour_logprobs)[sel].abs().max()
            checked.append((step - v, float(moved)))
        self.model.load_state_dict(now)
        return update(self, exp)

    monkeypatch.setattr(AsyncSchedule, "start", recording_start)
    monkeypatch.setattr(AsyncSchedule, "sync_weights", recording_sync)
    monkeypatch.setattr(GroupBuffer, "take", recording_take)
    monkeypatch.setattr(ActorWorker, "update", checking_update)
    _train(cfg)
    assert len(taken) == 5
    # the check had teeth: stale tokens whose logprob under the current weights differs
    assert any(stale > 0 and moved > 1e-3 for stale, moved in checked), checked
    switches = [sum(a != b for a, b in itertools.pairwise(s.versions)) for t in taken for s in t]
    interrupts = [s.num_interrupts for t in taken for s in t]
    assert all(s <= i for s, i in zip(switches, interrupts, strict=True))  # never unasked
    # interrupted sequences went on under the new weights (whether an update lands while a
    # sequence is in flight depends on the machine's timing: checked when one did)
    assert max(switches) > 0 or max(interrupts) == 0
    rows = [r for r in _metrics(tmp_path / "run") if "reward_mean" in r]
    fracs = [sum(s.num_interrupts > 0 for s in t) / len(t) for t in taken]
    assert [r["interrupted_frac"] for r in rows] == pytest.approx(fracs)
