"""The hold-out: the eval set drawn out of the training rows with the run's seed, never trained on.

Used when ``data.eval_path`` is unset and the prompts come from a dataset (``task: jsonl``): the
``data.eval_size`` prompts ``hold_out_rows`` picks leave training (every row holding one of
them) and are the eval set. A generated task (``task: arithmetic``) has a held-out stream of
its own instead (``relayrl.data.prompts.tasks``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from relayrl.data.prompts.tokens import RowCache, TokenizedPrompt

__all__ = ["hold_out_rows"]


def hold_out_rows(
    prompts: Sequence[str],
    candidates: Sequence[int],
    cache: RowCache,
    n: int,
    seed: int,
    where: str,
) -> tuple[set[str], list[TokenizedPrompt]]:
    """``n`` distinct prompts among the rows ``candidates`` (the non-blank rows), drawn with
    the run's seed, as the eval set (each prompt's first row, in file order): the prompts
    ``random.Random(f"relayrl.hold_out:{seed}").sample(distinct, n)`` picks, ``distinct`` the
    candidates' prompts in order of first appearance. A chosen prompt that is too long to use is
    replaced by further draws of the same generator (``randrange`` over ``distinct``, skipping
    prompts chosen already). Returns (every chosen prompt, the too-long ones included: their
    rows all leave training; the eval set). At most half of the distinct prompts are held out:
    more is an error naming both keys (``where`` is the file)."""
    cand = prompts if len(candidates) == len(prompts) else [prompts[i] for i in candidates]
    rows = candidates if len(candidates) == len(prompts) else list(candidates)
    distinct = list(dict.fromkeys(cand))  # in order of first appearance
    # each prompt's first row: later assignments win, so assign from the end
    first = dict(zip(reversed(cand), reversed(rows), strict=True))

    def too_few(count: int) -> ValueError:
        return ValueError(
            f"{where}: {count} distinct usable prompts; holding out "
            f"data.eval_size={n} for the evaluation would leave {max(count - n, 0)} to train "
            f"on (at most half, {count // 2}, are held out): set data.eval_path or a smaller "
            "data.eval_size"
        )

    if len(distinct) < 2 * n:
        raise too_few(len(distinct))
    rng = random.Random(f"relayrl.hold_out:{seed}")
    chosen = rng.sample(distinct, n)
    chosen_set = set(chosen)
    got = cache.get([first[p] for p in chosen])
    kept = [first[p] for p, t in zip(chosen, got, strict=True) if t is not None]
    attempts = 0
    while len(kept) < n and attempts < 20 * n + 1000:
        attempts += 1
        p = distinct[rng.randrange(len(distinct))]
        if p in chosen_set:
            continue
        chosen_set.add(p)
        if cache.get([first[p]])[0] is not None:
            kept.append(first[p])
    if len(kept) < n:  # most prompts too long: look at all of them
        cache.scan_all()
        usable_distinct = [p for p in distinct if cache.get([first[p]])[0] is not None]
        if len(usable_distinct) < 2 * n:
            raise too_few(len(usable_distinct))
        rest = [p for p in usable_distinct if p not in chosen_set]
        for p in rng.sample(rest, n - len(kept)):
            chosen_set.add(p)
            kept.append(first[p])
    eval_set = [t for t in cache.get(sorted(kept)) if t is not None]
    return chosen_set, eval_set
