"""Advantage estimators: (token_rewards, mask, ...) -> (advantages, returns), all [B, T].

Conventions shared by every estimator:

- Masked positions (holes included) are ignored: a reward or value sitting on a masked
  token is dropped, the recurrences jump from a valid token to the next valid one, and
  both outputs are exactly 0 there.
- A sequence's *score* is the sum of its token rewards over valid tokens (outcome rewards
  are placed on the last valid token, see ``kl.apply_kl_to_rewards``).
- ``group_index`` ([B] int tensor, or a list of any hashable ids) names each sequence's
  group (e.g. its prompt); groups need not be contiguous.
- ``episode_index`` (optional, same forms as ``group_index``) names the episode each
  sequence belongs to: a multi-turn episode trained as several sequences (segments of a
  prefix break). GRPO, Dr.GRPO, RLOO: the episode shares one score (its last sequence's)
  and one group, and counts once in its group's mean and std; every one of its sequences
  gets the episode's advantage. GAE, REINFORCE++ and REINFORCE++-baseline: the recurrence
  runs along the episode's valid tokens across its sequences *in batch order* (row i before
  row j when i < j; the rows need not be adjacent), as if they were one sequence: t' of a
  sequence's last valid token is the first valid token of the episode's next sequence that
  has one (V, A, G = 0 past the episode's last valid token), so the episode's outcome
  belongs on its last sequence only; REINFORCE++-baseline's s is the episode's G at its
  first valid token, counted once in its group's mean. ``relayrl.env.scoring.expand_episodes``
  gives that order: an episode's segments as it made them, then its own sample last.
- Group baselines are computed around the group's minimum score, so a group whose scores
  are all equal is centred to exactly 0 before any division or batch whitening (no
  ``x - mean(x) = 1e-17`` residue that a tiny std would blow up).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from relayrl.algos.masked import as_bool_mask, masked_sum, masked_whiten, zero_masked

GroupIndex = Tensor | Sequence[Hashable]


def _check_bt(name: str, x: Tensor, mask: Tensor) -> None:
    if x.dim() != 2 or x.shape != mask.shape:
        raise ValueError(
            f"{name} {tuple(x.shape)} and response_mask {tuple(mask.shape)} must both be [B, T]"
        )


def _group_inverse(group_index: GroupIndex, batch_size: int, device: torch.device) -> Tensor:
    """Map arbitrary group ids to compact ids 0..G-1 (int64 [B], on ``device``)."""
    if isinstance(group_index, Tensor):
        ids = group_index.reshape(-1)
        if ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"group_index must hold integer ids, got dtype {ids.dtype}")
        if ids.numel() != batch_size:
            raise ValueError(f"group_index has {ids.numel()} ids for {batch_size} sequences")
        return torch.unique(ids.to(device), return_inverse=True)[1]
    ids_list = list(group_index)
    if len(ids_list) != batch_size:
        raise ValueError(f"group_index has {len(ids_list)} ids for {batch_size} sequences")
    compact: dict[Hashable, int] = {}
    inverse = [compact.setdefault(g, len(compact)) for g in ids_list]
    return torch.tensor(inverse, dtype=torch.long, device=device)


def _group_sum(x: Tensor, inverse: Tensor) -> Tensor:
    """[B]: each sequence gets the sum of ``x`` over its group (compact ids are < B)."""
    return torch.zeros_like(x).index_add(0, inverse, x)[inverse]


def _group_centre(scores: Tensor, inverse: Tensor) -> tuple[Tensor, Tensor]:
    """(scores - group mean, group size), both [B].

    The mean is taken around the group's minimum (detached: the mean does not depend on the
    shift), so equal scores give an exact 0 and the sum is better conditioned.
    """
    counts = _group_sum(torch.ones_like(scores), inverse)
    ref = torch.zeros_like(scores).scatter_reduce(
        0, inverse, scores.detach(), reduce="amin", include_self=False
    )
    shifted = scores - ref[inverse]
    centred = shifted - _group_sum(shifted, inverse) / counts
    return centred, counts


def _per_episode(
    scores: Tensor, inverse: Tensor, episode_index: GroupIndex | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(scores [E], compact group ids [E], row -> episode [B] or None): one entry per episode.

    Without ``episode_index`` every sequence is its own episode (``None`` back-map). An
    episode's score is its last sequence's (the final turn, where the outcome sits; its
    segments carry the same score unless one lost its every token); its rows must share one
    group (ValueError otherwise)."""
    if episode_index is None:
        return scores, inverse, None
    batch = len(scores)
    ep = _group_inverse(episode_index, batch, scores.device)
    n_ep = int(ep.max()) + 1 if batch else 0
    rows = torch.arange(batch, device=scores.device)
    last = torch.full((n_ep,), -1, dtype=torch.long, device=scores.device)
    last = last.scatter_reduce(0, ep, rows, reduce="amax", include_self=True)
    ep_scores, ep_groups = scores[last], inverse[last]
    if not torch.equal(inverse, ep_groups[ep]):
        raise ValueError("episode_index: the sequences of one episode must share one group")
    return ep_scores, torch.unique(ep_groups, return_inverse=True)[1], ep


def discounted_returns(
    token_rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    episode_index: GroupIndex | None = None,
) -> Tensor:
    """Return-to-go G_t = r_t + gamma * G_{t'} with t' the next valid token (0 where masked).

    The Monte-Carlo return of REINFORCE (Williams 1992): :func:`compute_gae` with V = 0 and
    lambda = 1. With ``episode_index`` t' runs on across an episode's rows (module docstring).
    """
    _check_bt("token_rewards", token_rewards, response_mask)
    mask = as_bool_mask(response_mask)
    rewards = zero_masked(token_rewards, mask)
    return _chained_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0, episode_index)


def _successors(episode_index: GroupIndex, batch: int, device: torch.device) -> list[int]:
    """[B]: the row after each row in its episode (batch order), -1 for an episode's last row."""
    ep = _group_inverse(episode_index, batch, device).tolist()
    after: dict[int, int] = {}
    nxt = [-1] * batch
    for b in reversed(range(batch)):
        nxt[b] = after.get(ep[b], -1)
        after[ep[b]] = b
    return nxt


def _gae_scan(
    rewards: Tensor,
    vals: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    carry: tuple[Tensor, Tensor],
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """A [B, T] of rows whose next valid token after their last has value and advantage
    ``carry`` ([B] each); with the (V, A) of each row's first valid token (``carry`` if none)."""
    next_value, next_adv = carry
    length = rewards.shape[1]
    advs: list[Tensor] = [torch.zeros_like(next_adv)] * length
    for t in reversed(range(length)):
        valid = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        advs[t] = torch.where(valid, adv_t, torch.zeros_like(adv_t))
        next_value = torch.where(valid, vals[:, t], next_value)
        next_adv = torch.where(valid, adv_t, next_adv)
    out = torch.stack(advs, dim=1) if length else vals.clone()
    return out, (next_value, next_adv)


def _chained_gae(
    rewards: Tensor,
    vals: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    episode_index: GroupIndex | None,
) -> Tensor:
    """GAE advantages [B, T] (rewards, values already 0 where masked), each row's recurrence
    continuing into the next row of its episode: rows are done last-row-first, a row's
    carry-in being the (V, A) of its successor's first valid token (V = A = 0 for an
    episode's last row; a successor without a valid token passes its own carry-in on)."""
    if episode_index is None:
        zero = vals.new_zeros(vals.shape[0])
        return _gae_scan(rewards, vals, mask, gamma, lam, (zero, zero))[0]
    batch = rewards.shape[0]
    nxt = _successors(episode_index, batch, rewards.device)
    depth = [0] * batch  # rows after this one in its episode
    for b in reversed(range(batch)):
        depth[b] = depth[nxt[b]] + 1 if nxt[b] >= 0 else 0
    advantages = torch.zeros_like(vals)
    head_v, head_a = vals.new_zeros(batch), vals.new_zeros(batch)
    for d in range(max(depth, default=-1) + 1):
        level = [b for b in range(batch) if depth[b] == d]
        rows = torch.tensor(level, dtype=torch.long, device=vals.device)
        succ = torch.tensor([nxt[b] for b in level], dtype=torch.long, device=vals.device)
        has_next = succ >= 0
        carry = (
            torch.where(has_next, head_v[succ.clamp(min=0)], 0.0),
            torch.where(has_next, head_a[succ.clamp(min=0)], 0.0),
        )
        adv, (first_v, first_a) = _gae_scan(
            rewards[rows], vals[rows], mask[rows], gamma, lam, carry
        )
        advantages = advantages.index_copy(0, rows, adv)
        head_v = head_v.index_copy(0, rows, first_v)
        head_a = head_a.index_copy(0, rows, first_a)
    return advantages


def compute_gae(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = False,
    episode_index: GroupIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    delta_t = r_t + gamma * V_{t'} - V_t,  A_t = delta_t + gamma * lam * A_{t'},  where t' is
    the next *valid* token (V, A = 0 past the last one); returns R_t = A_t + V_t.
    ``whiten`` applies batch-level masked whitening to A *after* R is formed (R keeps the
    raw scale, as the critic target). Both outputs are 0 at masked positions. With
    ``episode_index`` t' runs on from a sequence's last valid token into the next sequence of
    its episode (module docstring): the advantages and returns of the unbroken episode.
    """
    _check_bt("token_rewards", token_rewards, response_mask)
    _check_bt("values", values, response_mask)
    mask = as_bool_mask(response_mask)
    rewards = zero_masked(token_rewards, mask)
    vals = zero_masked(values, mask)
    advantages = _chained_gae(rewards, vals, mask, gamma, lam, episode_index)
    returns = zero_masked(advantages + vals, mask)
    if whiten:
        advantages = masked_whiten(advantages, mask)
    return advantages, returns


def compute_grpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: GroupIndex,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    singleton: str = "zero",
    episode_index: GroupIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300).

    A_i = (r_i - mean_g r) / (std_g r + eps) with r_i the sequence score and std the unbiased
    group std; ``norm_by_std=False`` gives Dr.GRPO's r_i - mean_g r (Liu et al. 2025).
    A_i is broadcast to every valid token of sequence i; returns == advantages.
    A singleton group gets A = 0 (``singleton="zero"``: the std of one sample is undefined,
    we define the advantage as 0, not NaN); ``singleton="score"`` is veRL's convention (mean
    0 and std 1 for a group of one): A = r_i / (1 + eps) (r_i without std normalisation).
    A group of equal rewards gets exactly 0. With ``episode_index`` the mean, std and group
    size run over episodes (module docstring), A_i of an episode going to all its sequences.
    """
    _check_bt("token_rewards", token_rewards, response_mask)
    mask = as_bool_mask(response_mask)
    row_scores = masked_sum(token_rewards, mask, dim=-1)
    row_inverse = _group_inverse(group_index, len(row_scores), row_scores.device)
    scores, inverse, back = _per_episode(row_scores, row_inverse, episode_index)
    centred, counts = _group_centre(scores, inverse)
    multi = counts >= 2
    if norm_by_std:
        var = _group_sum(centred**2, inverse) / (counts - 1).clamp(min=1)
        # A zero-variance group has centred == 0 exactly: give it 0 (even with eps = 0), and
        # keep var = 0 away from sqrt, whose derivative there is infinite (NaN gradients).
        positive = var > 0
        std = torch.sqrt(torch.where(positive, var, 1.0))
        seq_adv = torch.where(positive, centred / (std + eps), 0.0)
    else:
        seq_adv = centred
    seq_adv = torch.where(multi, seq_adv, _singleton_advantage(scores, singleton, norm_by_std, eps))
    if back is not None:
        seq_adv = seq_adv[back]
    advantages = zero_masked(seq_adv[:, None].expand_as(mask), mask)
    return advantages, advantages.clone()


SINGLETON_CONVENTIONS = ("zero", "score")


def _singleton_advantage(scores: Tensor, singleton: str, norm_by_std: bool, eps: float) -> Tensor:
    """What a group of one gets: 0 (relayrl) or its raw score (veRL: mean 0, std 1)."""
    if singleton == "zero":
        return torch.zeros_like(scores)
    if singleton == "score":
        return scores / (1.0 + eps) if norm_by_std else scores
    raise ValueError(f"unknown singleton convention {singleton!r}; known: ['zero', 'score']")


def compute_drgrpo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: GroupIndex,
    singleton: str = "zero",
    episode_index: GroupIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """Dr.GRPO advantage (Liu et al. 2025, arXiv:2503.20783): A_i = r_i - mean_g r, no std.

    Same conventions as :func:`compute_grpo` (singleton or equal-reward group -> 0).
    """
    return compute_grpo(
        token_rewards,
        response_mask,
        group_index,
        norm_by_std=False,
        singleton=singleton,
        episode_index=episode_index,
    )


def compute_rloo(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: GroupIndex,
    episode_index: GroupIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_g r), broadcast to valid tokens;
    returns == advantages. A singleton group has no other sample to form a baseline: we
    define its advantage as 0 (documented choice, like GRPO). Equal rewards -> exactly 0.
    With ``episode_index``, G and the mean count episodes (module docstring).
    """
    _check_bt("token_rewards", token_rewards, response_mask)
    mask = as_bool_mask(response_mask)
    row_scores = masked_sum(token_rewards, mask, dim=-1)
    row_inverse = _group_inverse(group_index, len(row_scores), row_scores.device)
    scores, inverse, back = _per_episode(row_scores, row_inverse, episode_index)
    centred, counts = _group_centre(scores, inverse)
    seq_adv = centred * counts / (counts - 1).clamp(min=1)
    seq_adv = torch.where(counts >= 2, seq_adv, torch.zeros_like(seq_adv))
    if back is not None:
        seq_adv = seq_adv[back]
    advantages = zero_masked(seq_adv[:, None].expand_as(mask), mask)
    return advantages, advantages.clone()


def compute_reinforce_plus_plus(
    token_rewards: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    episode_index: GroupIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): A_t = whiten(G_t) over all valid tokens of the
    batch, G_t the discounted return-to-go (with ``episode_index``, run on across an episode's
    rows: module docstring). Returns (A, G): G is the un-whitened return."""
    returns = discounted_returns(token_rewards, response_mask, gamma, episode_index)
    return masked_whiten(returns, response_mask), returns


def _episode_heads(scores: Tensor, has_tokens: Tensor, episode_index: GroupIndex) -> Tensor:
    """[B]: each row gets ``scores`` of its episode's first row (batch order) with a valid
    token, 0 where the episode has none."""
    batch = len(scores)
    ep = _group_inverse(episode_index, batch, scores.device)
    n_ep = int(ep.max()) + 1 if batch else 0
    rows = torch.arange(batch, device=scores.device)
    key = torch.where(has_tokens, rows, batch)
    first = torch.full((n_ep,), batch, dtype=torch.long, device=scores.device)
    first = first.scatter_reduce(0, ep, key, reduce="amin", include_self=True)
    found = first < batch
    head = scores[first.clamp(max=max(batch - 1, 0))] if batch else scores
    return torch.where(found, head, torch.zeros_like(head))[ep]


def compute_reinforce_plus_plus_baseline(
    token_rewards: Tensor,
    response_mask: Tensor,
    group_index: GroupIndex,
    gamma: float = 1.0,
    target: str = "return",
    singleton: str = "zero",
    episode_index: GroupIndex | None = None,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025, arXiv:2501.03262): A_t = whiten(G_t - mean_g s) over the
    batch, s_i = G at sequence i's first valid token (= its score when gamma = 1).
    With ``episode_index`` G_t runs on across an episode's rows as REINFORCE++'s does (module
    docstring: the outcome on its last row only), s_e = G at the episode's first valid token
    (in its first row that has one; 0 if none: the unbroken episode's s) on every row of the
    episode, and the group mean and size run over episodes.

    ``target="return"`` (relayrl) subtracts the group mean from the return-to-go G_t;
    ``target="score"`` (veRL) from the sequence score s_i on every token: the two agree when
    gamma = 1 and the only reward is the score on the last token, and differ with gamma < 1 or
    per-token rewards. Before whitening, a group of equal scores has 0 advantage (gamma = 1); a
    singleton group has 0 (``singleton="zero"``) or, as veRL (group mean 0), its own target
    (``singleton="score"``). Whitening then shifts and scales with the rest of the batch.
    Returns (A, A), as veRL does.
    """
    mask = as_bool_mask(response_mask)
    returns = discounted_returns(token_rewards, mask, gamma, episode_index)
    batch, length = mask.shape
    positions = torch.arange(length, device=mask.device).expand(batch, length)
    first = torch.where(mask, positions, length).amin(-1) if length else mask.new_zeros(batch)
    has_tokens = first < length
    if length:
        start = returns.gather(1, first.clamp(max=length - 1).long()[:, None]).squeeze(1)
    else:
        start = returns.new_zeros(batch)
    scores = torch.where(has_tokens, start, torch.zeros_like(start))
    if episode_index is not None:
        scores = _episode_heads(scores, has_tokens, episode_index)
    row_inverse = _group_inverse(group_index, batch, scores.device)
    ep_scores, ep_inverse, back = _per_episode(scores, row_inverse, episode_index)
    centred, counts = _group_centre(ep_scores, ep_inverse)
    baseline = ep_scores - centred  # the group mean, exactly equal to s_i for equal scores
    if singleton == "score":
        baseline = torch.where(counts >= 2, baseline, torch.zeros_like(baseline))
    elif singleton != "zero":
        raise ValueError(f"unknown singleton convention {singleton!r}; known: ['zero', 'score']")
    if back is not None:
        baseline = baseline[back]
    if target == "return":
        raw = returns - baseline[:, None]
    elif target == "score":
        raw = (scores - baseline)[:, None].expand_as(returns)
    else:
        raise ValueError(
            f"unknown REINFORCE++-baseline target {target!r}; known: ['return', 'score']"
        )
    advantages = masked_whiten(zero_masked(raw, mask), mask)
    return advantages, advantages.clone()


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": compute_gae,
    "grpo": compute_grpo,
    "drgrpo": compute_drgrpo,
    "rloo": compute_rloo,
    "reinforce_plus_plus": compute_reinforce_plus_plus,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline,
}

_DATA_ARGS = ("token_rewards", "response_mask", "values", "group_index", "episode_index")


def compute_advantages(
    name: str,
    *,
    token_rewards: Tensor,
    response_mask: Tensor,
    values: Tensor | None = None,
    group_index: GroupIndex | None = None,
    episode_index: GroupIndex | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Dispatch to ``ADVANTAGE_ESTIMATORS[name]``.

    ``values`` / ``group_index`` are passed only to estimators that take them (and are
    required there); ``episode_index`` to those that take it (optional: counted once in group
    statistics, or chained along by GAE and REINFORCE++(-baseline); module docstring); every other
    keyword (gamma, lam, whiten, norm_by_std, eps) must be one the estimator accepts, else
    ValueError.
    """
    try:
        estimator = ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
    params = inspect.signature(estimator).parameters
    accepted = [p for p in params if p not in _DATA_ARGS]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ValueError(
            f"advantage estimator {name!r} does not accept {unknown}; it accepts {accepted}"
        )
    call: dict[str, Any] = {"token_rewards": token_rewards, "response_mask": response_mask}
    for arg, value in (("values", values), ("group_index", group_index)):
        if arg in params:
            if value is None:
                raise ValueError(f"advantage estimator {name!r} needs {arg}")
            call[arg] = value
    if episode_index is not None and "episode_index" in params:
        call["episode_index"] = episode_index
    return estimator(**call, **kwargs)
