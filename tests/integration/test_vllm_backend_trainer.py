"""rollout.backend=vllm through the trainer (the local cluster): the trainer's recompute of
vLLM's samples equals their behaviour logprobs (and the mismatch monitor's figures on them), and
GRPO with vLLM raises the held-out pass rate like the own engine does (slow).

Skipped unless ``import vllm`` works (``make test-vllm`` sets that environment up).
"""

from __future__ import annotations

import pytest

from vllm_engines import TOL, needs_vllm

pytestmark = [pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_sft_model(tmp_path_factory: pytest.TempPathFactory):
    """``helpers.make_sft_model``'s SFT-warm-started Llama, with 3 heads of 32 (vLLM's CPU
    attention has no head size 24, the fixture's 96 / 4)."""
    import functools

    import helpers
    from relayrl.model import build_tiny_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            helpers,
            "build_tiny_model",
            functools.partial(build_tiny_model, num_heads=3, num_kv_heads=1),
        )
        return helpers.make_sft_model(tmp_path_factory.mktemp("vllm-sft"), seed=helpers.TEST_SEED)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_rollout_logprobs_equal_trainer_logprobs(
    vllm_sft_model, tmp_path, temperature
) -> None:
    """The trainer's recompute (ActorWorker.compute_logprobs) of vLLM's samples, via the local
    cluster's factory (rollout.backend=vllm), and the mismatch monitor's figures on them."""
    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.algorithms import make_requests
    from relayrl.data.prompts import PromptSource
    from relayrl.rollout.vllm_backend import VllmEngine
    from relayrl.telemetry.mismatch import MismatchMonitor
    from relayrl.workers import Experience

    cfg = run_config(
        vllm_sft_model,
        tmp_path / "lp",
        "rollout.backend=vllm",
        f"rollout.temperature={temperature}",
        "rollout.vllm_kv_cache_gib=0.0625",
        "algo.prompts_per_step=8",
    )
    roles = build_local_roles(cfg, str(vllm_sft_model), None)
    try:
        assert isinstance(roles.rollout, VllmEngine)
        prompts = PromptSource(cfg.data, roles.tokenizer, cfg.seed).for_step(0, 8)
        reqs = make_requests(prompts, cfg, 0, [roles.tokenizer.eos_token_id])
        samples = roles.rollout.generate(reqs)
    finally:
        roles.close()
    exp = Experience.from_samples(samples, roles.tokenizer.pad_token_id)
    assert exp.response_mask.sum() > len(samples)
    trainer = roles.actor.compute_logprobs(exp)
    mon = MismatchMonitor(threshold=TOL)
    figures = mon.observe(exp.behaviour_logprobs, trainer, exp.response_mask, step=0)
    assert figures["mismatch/tokens"] == float(exp.response_mask.sum())
    assert figures["mismatch/max_abs"] < TOL and figures["mismatch/frac_over"] == 0.0, figures


def _metrics(run_dir) -> list[dict]:
    import json

    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.parametrize(
    "schedule,extra",
    [
        ("sync", ["train.steps=60"]),
        ("async", ["train.steps=80", "async.eta=2", "async.interrupt=true", "optim.lr=3e-4"]),
    ],
)
@needs_vllm
def test_grpo_with_vllm_raises_held_out_pass_rate(
    vllm_sft_model, tmp_path, schedule, extra, outcome
):
    """GRPO with rollout.backend=vllm learns like with the own engine (the same configs and
    thresholds as test_train_integration / test_async_integration): sync in this process,
    async (eta 2, interrupting re-prefill updates) in the engine worker process. Measured, seed
    0 (the only seed run with vLLM so far): sync 0.395 -> 0.49, async 0.395 -> 0.505; the own
    engine's tests measured min 0.155 / 0.135 over seeds 0-4 on their fixture."""
    from helpers import run_config
    from relayrl.cluster.local import build_local_roles
    from relayrl.controller.trainer import train

    cfg = run_config(
        vllm_sft_model,
        tmp_path / schedule,
        f"schedule={schedule}",
        "rollout.backend=vllm",
        "rollout.vllm_kv_cache_gib=0.0625",
        "data.eval_size=200",
        *extra,
    )
    out = train(cfg, lambda a, c: build_local_roles(cfg, a, c))
    outcome(before=out["eval_before"], after=out["eval_after"])
    assert out["eval_after"] >= out["eval_before"] + 0.05, out
    rows = [r for r in _metrics(tmp_path / schedule) if "reward_mean" in r]
    assert max(r["staleness_max"] for r in rows) <= (0 if schedule == "sync" else 2)
