"""The built-in arithmetic task: seeded problems like ``"3+5="`` with answer ``"8"``.

Problem ``i`` of a stream is a pure function of (stream, seed, i, config): it is drawn from
its own ``random.Random`` seeded with a string (hashed with SHA-512 by ``random``, so it
does not depend on ``PYTHONHASHSEED``). Training, SFT and held-out problems come from
three different streams, and the only state is the training cursor, which makes a resumed
run draw exactly the problems an uninterrupted run would.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

from relayrl.data.records import PromptRecord, SFTRecord

__all__ = ["ArithmeticTask"]

OPERATORS: tuple[str, ...] = ("+", "-", "*")


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of ``operands[0] ops[0] operands[1] ...`` with ``*`` binding tighter."""
    terms = [operands[0]]
    signs = [1]
    for op, x in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


class ArithmeticTask:
    """Seeded arithmetic problems with integer answers, scored by the ``arithmetic`` reward.

    Args:
        seed: base seed of every stream.
        min_operand, max_operand: inclusive operand range (negative operands are written
            in parentheses: ``"(-3)+5="``).
        operators: any of ``'+'``, ``'-'``, ``'*'``; each operator slot is drawn uniformly.
            With ``'-'`` answers may be negative; ``'*'`` binds tighter than ``+``/``-``.
        num_operands: operands per problem (>= 2).

    ``sample(n)`` returns the next ``n`` training problems and advances ``cursor``;
    ``held_out(n, seed)`` and ``sft_records(n)`` always return the first ``n`` problems of
    their own streams.
    """

    reward_fn = "arithmetic"

    def __init__(
        self,
        seed: int = 0,
        min_operand: int = 0,
        max_operand: int = 9,
        operators: Iterable[str] = ("+",),
        num_operands: int = 2,
    ) -> None:
        self.seed = _check_int("seed", seed)
        self.min_operand = _check_int("min_operand", min_operand)
        self.max_operand = _check_int("max_operand", max_operand)
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand ({min_operand}) must be <= max_operand ({max_operand})")
        if isinstance(operators, str):
            operators = tuple(operators)
        ops = tuple(operators)
        if not ops:
            raise ValueError("operators must not be empty (allowed: '+', '-', '*')")
        for op in ops:
            if op not in OPERATORS:
                raise ValueError(f"unknown operator {op!r} (allowed: '+', '-', '*')")
        self.operators: tuple[str, ...] = ops
        self.num_operands = _check_int("num_operands", num_operands)
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {num_operands}")
        self.cursor = 0

    def __repr__(self) -> str:
        return (
            f"ArithmeticTask(seed={self.seed}, min_operand={self.min_operand}, "
            f"max_operand={self.max_operand}, operators={self.operators!r}, "
            f"num_operands={self.num_operands})"
        )

    def problem(self, index: int, stream: str = "train", seed: int | None = None) -> PromptRecord:
        """Problem ``index`` of ``stream`` (``"train"``, ``"sft"``, ``"held_out"``, ...)."""
        base = self.seed if seed is None else seed
        rng = random.Random(f"relayrl.arithmetic:{stream}:{base}:{index}")
        operands = [
            rng.randint(self.min_operand, self.max_operand) for _ in range(self.num_operands)
        ]
        ops = [rng.choice(self.operators) for _ in range(self.num_operands - 1)]
        text = "".join(
            op + (f"({x})" if x < 0 else str(x)) for op, x in zip(["", *ops], operands, strict=True)
        )
        return PromptRecord(prompt=f"{text}=", answer=str(_evaluate(operands, ops)))

    def _stream(
        self, n: int, stream: str, start: int = 0, seed: int | None = None
    ) -> list[PromptRecord]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        return [self.problem(start + i, stream, seed) for i in range(n)]

    def sample(self, n: int) -> list[PromptRecord]:
        """The next ``n`` training problems (deterministic given seed, config and cursor)."""
        records = self._stream(n, "train", start=self.cursor)
        self.cursor += n
        return records

    def held_out(self, n: int, seed: int | None = None) -> list[PromptRecord]:
        """The first ``n`` problems of the held-out stream (``seed`` defaults to the task's).

        The held-out stream is distinct from the training stream even for the same seed;
        with a small operand range the same problem text can still occur in both.
        """
        return self._stream(n, "held_out", seed=seed)

    def sft_records(self, n: int) -> list[SFTRecord]:
        """The first ``n`` problems of the SFT stream as prompt/response pairs."""
        return [SFTRecord(r.prompt, r.answer or "") for r in self._stream(n, "sft")]

    def state_dict(self) -> dict[str, int]:
        """Checkpointable state: the training cursor."""
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore the training cursor from ``state_dict()``."""
        self.cursor = _check_int("cursor", state["cursor"])
