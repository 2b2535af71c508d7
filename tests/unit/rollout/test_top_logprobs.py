"""RolloutEngine's optional top-k logprob capture (``relayrl.rollout.top_logprobs``): the
alternatives are those of the distribution sampled from (hand-computed below), and asking for
them changes no sampled token and no behaviour logprob."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from relayrl.rollout import GenerationRequest, InvalidRequestError, RolloutEngine, SamplingParams
from relayrl.rollout import top_logprobs as top
from relayrl.rollout.sampler import SamplingSettings
from rollout_helpers import EOS, PAD, check_top_recompute, random_prompts, tiny_model


def _seq(k: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> SimpleNamespace:
    greedy = temperature == 0
    settings = SamplingSettings(
        greedy=greedy,
        temperature=1.0 if greedy else temperature,
        top_k=top_k,
        top_p=top_p,
        seed=0,
    )
    params = SimpleNamespace(top_logprobs=k)
    return SimpleNamespace(settings=settings, request=SimpleNamespace(params=params), top=[])


def test_the_alternatives_by_hand():
    """Logits log(1), log(2), log(3), log(4): probabilities .1 .2 .3 .4 at temperature 1.
    - temperature 1, k=2: (3, log .4), (2, log .3);
    - temperature 0.5: p^2 renormalised, 1 4 9 16 / 30: (3, log 16/30), (2, log 9/30);
    - top_k=2 (k=3 asked): only tokens 3, 2 survive, .4/.7 and .3/.7, two entries;
    - top_p=0.5: the mass before token 2 (.4) is < .5, before token 1 (.7) is not: the same two;
    - greedy (temperature 0): the temperature-1 distribution, as the behaviour logprob;
    - a row that asked for none is left alone."""
    row = torch.log(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    seqs = [
        _seq(2),
        _seq(2, temperature=0.5),
        _seq(3, top_k=2),
        _seq(3, top_p=0.5),
        _seq(1, temperature=0),
        _seq(0),
    ]
    seqs[-1].top = None
    top.capture(row.expand(len(seqs), 4).contiguous(), seqs)
    expected = [
        [(3, math.log(0.4)), (2, math.log(0.3))],
        [(3, math.log(16 / 30)), (2, math.log(9 / 30))],
        [(3, math.log(4 / 7)), (2, math.log(3 / 7))],
        [(3, math.log(4 / 7)), (2, math.log(3 / 7))],
        [(3, math.log(0.4))],
    ]
    for s, want in zip(seqs, expected, strict=False):
        (got,) = s.top
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-6)
    assert seqs[-1].top is None
    assert top.check(0) is None and top.check(20) is None
    assert top.check(21) is not None and top.check(-1) is not None and top.check(True) is not None


def test_vllm_positions_by_hand():
    """``from_ranked``: vLLM's entries of one position, (token, logprob, rank), sampled first.
    - sampled token 7 in the top 2 (rank 2): ranks 1, 2 kept, by rank: [(5, a), (7, b)];
    - sampled token 9 outside the top 2 (rank 4): dropped;
    - sampled token 9 tied with the 2nd (rank 2 too, not topk's pick): the one too many, dropped;
    - the server's entries for k + 1 = 3 (sampled 9 first, then ranks 1..3 cut to 3 entries):
      [(9, rank 4), (5, 1), (7, 2)] -> ranks <= 2: [(5, a), (7, b)];
    - a filtered token (-inf; over the server's JSON -9999.0) is left out."""
    a, b, c = math.log(0.5), math.log(0.3), math.log(0.1)
    assert top.from_ranked([(7, b, 2), (5, a, 1)], 7, 2) == [(5, a), (7, b)]
    assert top.from_ranked([(9, c, 4), (5, a, 1), (7, b, 2)], 9, 2) == [(5, a), (7, b)]
    assert top.from_ranked([(9, b, 2), (5, a, 1), (7, b, 2)], 9, 2) == [(5, a), (7, b)]
    assert top.from_ranked([(9, c, 4), (5, a, 1), (7, b, 2)], 9, 3) == [(5, a), (7, b)]
    inf = float("-inf")
    assert top.from_ranked([(5, 0.0, 1), (6, inf, 2), (7, inf, 3)], 5, 3) == [(5, 0.0)]
    server = [(5, 0.0, 1), (6, top.SERVER_FLOOR, 2)]
    assert top.from_ranked(server, 5, 2, removed=top.SERVER_FLOOR) == [(5, 0.0)]
    assert top.from_ranked([(5, a, None)], 5, 1) == []  # no rank: not a top entry


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return tiny_model(tmp_path_factory.mktemp("top"), "llama")


PARAMS = [
    dict(greedy=True),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
]


def _run(model: torch.nn.Module, ks: list[int], interrupt_at: int | None = None):
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3)
    prompts = random_prompts([5, 9, 3, 7, 4, 6], seed=3)
    reqs = [
        GenerationRequest(
            p,
            SamplingParams(
                max_tokens=12, seed=i, ignore_eos=True, top_logprobs=ks[i], **PARAMS[i % 4]
            ),
        )
        for i, p in enumerate(prompts)
    ]
    if interrupt_at is None:
        return engine.generate(reqs)
    ids = [engine.submit(r) for r in reqs]
    for _ in range(interrupt_at):
        engine.step()
    live = [rid for rid in ids if engine.progress(rid) is not None]
    widths = {len(engine.progress(rid) or ()) for rid in live}  # a streaming reader's view
    assert widths == ({3, 4} if any(ks) else {3})
    engine.update_weights(model.state_dict(), 1, interrupt=True)  # re-prefills the live rows
    done = {s.request_id: s for s in engine.drain()}
    return [done[rid] for rid in ids]


@pytest.mark.parametrize("interrupt_at", [None, 5])
def test_capture_changes_no_token_nor_logprob(model, interrupt_at):
    """The same requests (greedy, plain, top-k, top-p; some asking, some not) with and
    without alternatives: torch.equal tokens and behaviour logprobs; each token's list is at
    most k long, most likely first, and holds the sampled token at its behaviour logprob
    whenever that token is among the k (greedy: always, first)."""
    plain = _run(model, [0] * 6, interrupt_at)
    ks = [3, 0, 20, 4, 5, 2]
    asked = _run(model, ks, interrupt_at)
    for i, (a, b, k) in enumerate(zip(plain, asked, ks, strict=True)):
        assert torch.equal(torch.tensor(a.response_ids), torch.tensor(b.response_ids))
        assert torch.equal(
            torch.tensor(a.behaviour_logprobs, dtype=torch.float64),
            torch.tensor(b.behaviour_logprobs, dtype=torch.float64),
        )
        assert a.top_logprobs is None
        if not k:
            assert b.top_logprobs is None
            continue
        assert len(b.top_logprobs) == len(b.response_ids) == 12
        for tok, lp, alts in zip(b.response_ids, b.behaviour_logprobs, b.top_logprobs, strict=True):
            assert 1 <= len(alts) <= k
            values = [v for _, v in alts]
            assert values == sorted(values, reverse=True)
            mine = dict(alts)
            if tok in mine:
                assert mine[tok] == lp  # the same operations on the same row
            else:
                assert len(alts) == k and lp <= values[-1] + 1e-6
        if PARAMS[i % 4].get("greedy"):
            assert [alts[0][0] for alts in b.top_logprobs] == b.response_ids


def test_a_bad_top_logprobs_is_refused(model):
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=2)
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        engine.submit(GenerationRequest([5, 6], SamplingParams(top_logprobs=21)))


def test_the_scheduler_counts_the_requests_that_keep_alternatives(model):
    """The step's only cost while none asks: ``Scheduler.with_top``, back to 0 once the asking
    requests finished or were aborted (waiting or running)."""
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=1)
    ask = SamplingParams(max_tokens=3, top_logprobs=2, ignore_eos=True)
    a = engine.submit(GenerationRequest([5, 6], ask))
    engine.submit(GenerationRequest([5, 6], SamplingParams(max_tokens=3)))
    c = engine.submit(GenerationRequest([7], ask))  # waits: one slot
    assert engine.scheduler.with_top == 2
    engine.step()
    engine.abort(a)  # running
    engine.abort(c)  # waiting
    assert engine.scheduler.with_top == 0
    engine.submit(GenerationRequest([5, 6], ask))
    done = engine.drain()
    assert engine.scheduler.with_top == 0
    assert [len(s.top_logprobs or []) for s in done] == [1, 0, 0, 3]


def test_the_alternatives_equal_a_plain_forwards(model):
    """The recompute the vLLM tests hold vLLM to (``rollout_helpers.check_top_recompute``),
    here on the own engine: the same reference for every backend."""
    engine = RolloutEngine(model, eos_token_id=EOS, pad_token_id=PAD, max_slots=3)
    check_top_recompute(model, engine.generate, tol=1e-5)
