"""ReaLHF-style execution-plan search over the six-call PPO dataflow."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relayrl.plan.hardware import get_hardware
from relayrl.plan.models import get_model
from relayrl.plan.search import (
    CALLS,
    Mesh,
    PPOProblem,
    Strategy,
    asymmetric_plan,
    heuristic_plan,
    search_plan,
    symmetric_plan,
)


def realhf_example() -> PPOProblem:
    """The documented example (ReaLHF's): 7B actor/ref + 34B critic/reward, 4 x 8 A100,
    512 prompts, 128 prompt + 896 generated tokens."""
    a7, c34 = get_model("llama-2-7b"), get_model("codellama-34b")
    return PPOProblem(
        {"actor": a7, "ref": a7, "critic": c34, "reward": c34}, get_hardware("a100"), n_nodes=4
    )


@pytest.fixture(scope="module")
def example():
    pb = realhf_example()
    return pb, search_plan(pb, steps=1500, seed=0)


def test_search_beats_heuristic_and_fits(example):
    pb, best = example
    heur = pb.evaluate(heuristic_plan(pb))
    assert heur.fits
    assert best.fits and pb.fits(best.plan)
    # the two-phase memory model (plan/memory.py: 16 bytes/param of weights, gradients and
    # AdamW sharded by FSDP2, bf16 copies, activations and logit buffers; weights + AdamW
    # persistent, the rest transient) and the search started from the better of the greedy
    # descents from the heuristic and the symmetric plan: seeds 0 and 1 at 1500 steps and
    # seed 0 at 4000 all find 0.732 (peak 70.3 GB of the 76 GB cap); 0.9 under the previous
    # one-phase calibration (0.873 measured)
    assert best.iteration_s < 0.75 * heur.iteration_s
    sym = pb.evaluate(symmetric_plan(pb))
    # the symmetric plan (dp 4 x tp 8) fits (50 GB per GPU); the best plan is 0.972 of it
    assert sym.fits and best.iteration_s <= sym.iteration_s
    assert 0 <= best.realloc_share < 0.1
    assert set(best.plan) == {c.name for c in CALLS}


def test_asymmetric_34b_critic_on_4_gpus_does_not_fit():
    pb = realhf_example()
    plan = asymmetric_plan(pb)
    assert plan["critic_train"][0].size == 4
    ev = pb.evaluate(plan)
    assert not ev.fits
    # 34B trained on 4 GPUs: 16 bytes/param / 4 = 136 GB per GPU before activations
    assert ev.peak_memory_bytes > 136e9


def test_timeline_respects_dependencies_and_overlaps_disjoint_meshes():
    pb = realhf_example()
    plan = heuristic_plan(pb)
    plan["actor_train"] = (Mesh(0, 16), Strategy(2, 8, 1))
    plan["critic_train"] = (Mesh(16, 16), Strategy(1, 8, 2))
    ev = pb.evaluate(plan)
    sp = {(s["call"], s["iteration"]): s for s in ev.spans}
    for it in (0, 1):
        gen = sp[("actor_gen", it)]
        for c in ("ref_inf", "reward_inf", "critic_inf"):
            assert sp[(c, it)]["start"] >= gen["end"] - 1e-9
    assert sp[("actor_gen", 1)]["start"] >= sp[("actor_train", 0)]["end"] - 1e-9
    a, c = sp[("actor_train", 0)], sp[("critic_train", 0)]
    assert a["start"] < c["end"] and c["start"] < a["end"]  # disjoint meshes run together


def test_reallocation_cost():
    pb = realhf_example()
    full = (Mesh(0, 8), Strategy(1, 8, 1))
    assert pb.realloc_time("actor", full, full) == 0.0
    # tp 8 -> tp 2 on the same GPUs: each GPU receives 1/2 - 1/8 of the weights over NVLink
    t = pb.realloc_time("actor", full, (Mesh(0, 8), Strategy(4, 2, 1)))
    w = get_model("llama-2-7b").weight_bytes
    assert t == pytest.approx((1 / 2 - 1 / 8) * w / get_hardware("a100").intra_node_bandwidth)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actor=st.sampled_from(["qwen2.5-1.5b", "llama-2-7b", "llama-2-13b"]),
    critic=st.sampled_from(["qwen2.5-1.5b", "llama-2-7b", "codellama-34b"]),
    nodes=st.integers(1, 2),
    seed=st.integers(0, 100),
)
def test_search_never_returns_a_plan_failing_memory(actor, critic, nodes, seed):
    pb = PPOProblem(
        {
            "actor": get_model(actor),
            "ref": get_model(actor),
            "critic": get_model(critic),
            "reward": get_model(critic),
        },
        get_hardware("a100"),
        n_nodes=nodes,
        batch=256,
    )
    try:
        best = search_plan(pb, steps=100, seed=seed)
    except ValueError as exc:
        assert "fits" in str(exc)
        return
    assert best.fits and pb.fits(best.plan)


def test_no_feasible_plan_raises():
    seventy = get_model("70b")
    pb = PPOProblem(
        {r: seventy for r in ("actor", "critic", "ref", "reward")}, get_hardware("a100"), n_nodes=1
    )
    with pytest.raises(ValueError, match="fits"):
        search_plan(pb, steps=50)


def test_search_memory_is_the_calibrated_training_memory_model():
    """A GPU hosting only the actor's training holds exactly the two-phase model's peak
    (plan/memory.py) of its per-rank shape: 7B over tp 4 and FSDP2 dp 2, bf16, foreach AdamW."""
    from relayrl.plan.memory import CALIBRATED, CHUNKED_LOGIT_BYTES

    pb = realhf_example()
    a7 = pb.models["actor"]
    plan = heuristic_plan(pb)
    s = Strategy(2, 4, 1)
    plan["actor_train"] = (Mesh(0, 8), s)
    other = (Mesh(8, 24), Strategy(1, 8, 3))
    for name in plan:
        if name != "actor_train":
            plan[name] = other
    shape = pb.train_shape("actor", s)
    expected = CALIBRATED.peak_bytes(shape)
    assert pb.train_memory("actor", s) == pytest.approx(expected, rel=1e-12)
    mem = pb.memory(plan)
    assert mem[0] == pytest.approx(expected, rel=1e-12)
    # by hand: n = 7B / 4 parameters per GPU, sharded over dp 2; E = V h / 4 (lm_head shard)
    c = CALIBRATED
    n = a7.params / 4
    h, V, L, T = a7.hidden // 4, a7.vocab // 4, a7.layers, pb.micro_batch_tokens
    r = pb.gen_len / (pb.prompt_len + pb.gen_len)
    e = a7.vocab * a7.hidden / 4
    p_l = (n - e) / L
    wgs = 16 * n / 2  # W 4 + G 4 + S 8 bytes per parameter, over 2 ranks
    act = T * h * (c.a_bf16 * L + c.a0)
    # the lm_head on the gen + 1 last positions of a row (bf16), the chunked fp32 logprobs
    kept = (pb.gen_len + 1) / (pb.prompt_len + pb.gen_len)
    logits = kept * T * V * 2 + CHUNKED_LOGIT_BYTES * r * T * V
    fsdp = (2 * 2 + 4) * p_l  # two gathered bf16 layers + one fp32 layer gradient
    backward = wgs + act + logits + fsdp + c.overhead
    optimizer = wgs + 4 * n / 2 + c.overhead  # foreach AdamW: sqrt(v) of the whole shard
    assert mem[0] == pytest.approx(max(backward, optimizer), rel=1e-12)
    # between updates only weights and AdamW stay (W + S + C)
    assert pb.train_persistent("actor", s) == pytest.approx(12 * n / 2 + c.overhead)


def test_train_shape_keeps_the_actors_response_logits_only():
    """The actor's update runs the lm_head on the gen + 1 last positions and chunks its
    logprobs (as ``relayrl.model.forward_logprobs`` does); the critic's one-output head does
    not."""
    pb = realhf_example()
    s = Strategy(1, 8, 1)
    actor, critic = pb.train_shape("actor", s), pb.train_shape("critic", s)
    assert actor.logits_kept == pytest.approx(897 / 1024) and actor.chunked_logprobs
    assert critic.logits_kept == 1.0 and not critic.chunked_logprobs
