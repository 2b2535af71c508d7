"""Property: masked positions (holes included) never influence any output or gradient.

Every masked-aware function runs twice: once on clean inputs, once with the masked slots
overwritten by garbage (NaN, +-inf, 1e30, ...). Outputs must be bitwise identical and finite,
gradients identical, and the gradient at every masked slot exactly 0.
"""

from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relayrl.algos import (
    AGGREGATION_MODES,
    LossNorm,
    aggregate_loss,
    apply_kl_to_rewards,
    clipped_value_loss,
    compute_drgrpo,
    compute_gae,
    compute_grpo,
    compute_reinforce_plus_plus,
    compute_reinforce_plus_plus_baseline,
    compute_rloo,
    decoupled_ppo_loss,
    kl_penalty,
    masked_mean,
    masked_whiten,
    ppo_clip_loss,
)

D = torch.float64
GARBAGE = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 55.0], dtype=D)

Inputs = dict[str, torch.Tensor]
Case = Callable[[Inputs, torch.Tensor, list[int], LossNorm], list[torch.Tensor | dict]]

CASES: dict[str, tuple[tuple[str, ...], Case]] = {
    "gae": (("r", "v"), lambda x, m, g, n: list(compute_gae(x["r"], x["v"], m))),
    "gae_discounted_whitened": (
        ("r", "v"),
        lambda x, m, g, n: list(compute_gae(x["r"], x["v"], m, 0.9, 0.8, whiten=True)),
    ),
    "grpo": (("r",), lambda x, m, g, n: list(compute_grpo(x["r"], m, g))),
    "drgrpo": (("r",), lambda x, m, g, n: list(compute_drgrpo(x["r"], m, g))),
    "rloo": (("r",), lambda x, m, g, n: list(compute_rloo(x["r"], m, g))),
    "reinforce_plus_plus": (
        ("r",),
        lambda x, m, g, n: list(compute_reinforce_plus_plus(x["r"], m, gamma=0.9)),
    ),
    "reinforce_plus_plus_baseline": (
        ("r",),
        lambda x, m, g, n: list(compute_reinforce_plus_plus_baseline(x["r"], m, g, gamma=0.9)),
    ),
    "ppo": (
        ("logp", "old", "adv"),
        lambda x, m, g, n: list(ppo_clip_loss(x["logp"], x["old"], x["adv"], m, n, dual_clip=3.0)),
    ),
    "decoupled_ppo": (
        ("logp", "old", "behav", "adv"),
        lambda x, m, g, n: list(
            decoupled_ppo_loss(x["logp"], x["old"], x["behav"], x["adv"], m, n, dual_clip=3.0)
        ),
    ),
    "value": (
        ("v", "old", "r"),
        lambda x, m, g, n: list(clipped_value_loss(x["v"], x["old"], x["r"], m, n)),
    ),
    "kl_k1": (("logp", "old"), lambda x, m, g, n: [kl_penalty(x["logp"], x["old"], "k1", m)]),
    "kl_k2": (("logp", "old"), lambda x, m, g, n: [kl_penalty(x["logp"], x["old"], "k2", m)]),
    "kl_k3": (("logp", "old"), lambda x, m, g, n: [kl_penalty(x["logp"], x["old"], "k3", m)]),
    "kl_abs": (("logp", "old"), lambda x, m, g, n: [kl_penalty(x["logp"], x["old"], "abs", m)]),
    "kl_rewards": (
        ("logp", "old"),
        lambda x, m, g, n: list(
            apply_kl_to_rewards(torch.arange(len(g), dtype=D), x["logp"], x["old"], m, 0.1, "k3")
        ),
    ),
    "aggregate": (("r",), lambda x, m, g, n: [aggregate_loss(x["r"], m, n)]),
    "masked_mean": (("r",), lambda x, m, g, n: [masked_mean(x["r"], m), masked_mean(x["r"], m, 1)]),
    "masked_whiten": (("r",), lambda x, m, g, n: [masked_whiten(x["r"], m)]),
}

NAMES = ("r", "v", "logp", "old", "behav", "adv")


@st.composite
def masked_cases(draw: st.DrawFn) -> tuple:
    b, t = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
    groups = draw(st.lists(st.integers(0, 2), min_size=b, max_size=b))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    clean = {name: torch.randn(b, t, generator=g, dtype=D) for name in NAMES}
    clean["logp"] = clean["old"] + 0.5 * clean["logp"]  # ratios around 1, some clipped
    clean["behav"] = clean["old"] - 0.8 * clean["behav"].abs()  # weights >= 1, some capped
    picks = torch.randint(0, len(GARBAGE), (b, t), generator=g)
    dirty = {k: torch.where(mask, v, GARBAGE[picks]) for k, v in clean.items()}
    float_mask = draw(st.booleans())
    mode = draw(st.sampled_from(AGGREGATION_MODES))
    return (
        mask.reshape(b, t).to(D) if float_mask else mask.reshape(b, t),
        groups,
        clean,
        dirty,
        mode,
    )


def _run(case: Case, differentiable: tuple[str, ...], inputs: Inputs, mask, groups, norm, g):
    leaves = {k: v.clone().requires_grad_(k in differentiable) for k, v in inputs.items()}
    outputs = case(leaves, mask, groups, norm)
    tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
    stats = [o for o in outputs if isinstance(o, dict)]
    total = sum((o * torch.randn(o.shape, generator=g, dtype=D)).sum() for o in tensors)
    grads = {}
    if total.requires_grad:
        total.backward()
    for k in differentiable:
        grad = leaves[k].grad
        grads[k] = torch.zeros_like(leaves[k]) if grad is None else grad
    return tensors, stats, grads


@settings(max_examples=50, deadline=None)
@given(masked_cases())
def test_masked_positions_never_influence_outputs_or_gradients(case: tuple) -> None:
    mask, groups, clean, dirty, mode = case
    bool_mask = mask.bool()
    norm = LossNorm.for_batch(mask, mode, norm_constant=6.0)
    for name, (differentiable, fn) in CASES.items():
        seed = len(name)  # same cotangent for the clean and the dirty run
        out_c, stats_c, grad_c = _run(
            fn, differentiable, clean, mask, groups, norm, torch.Generator().manual_seed(seed)
        )
        out_d, stats_d, grad_d = _run(
            fn, differentiable, dirty, mask, groups, norm, torch.Generator().manual_seed(seed)
        )
        for a, b in zip(out_c, out_d, strict=True):
            assert torch.isfinite(b).all(), name
            assert torch.equal(a, b), name
        assert stats_c == stats_d, name
        for k in differentiable:
            assert torch.equal(grad_c[k], grad_d[k]), (name, k)
            assert (grad_d[k][~bool_mask] == 0).all(), (name, k)
