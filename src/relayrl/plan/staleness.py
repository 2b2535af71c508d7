"""The AReaL staleness gate as pure integer arithmetic (no imports from relayrl, no numpy).

AReaL (Fu et al., 2025) admits a new generation request only while

    floor((N_r - 1) / B) <= i + eta

where ``N_r`` counts the admitted units *including the one being admitted* (trajectories, or
prompt groups when a whole group is admitted at once), ``B`` is the number of units consumed
by one training step, ``i`` is the trainer's current policy version (the number of finished
training steps) and ``eta`` is the staleness bound (``None`` means unbounded).

Unit ``n`` (1-based) belongs to training batch ``k = floor((n - 1) / B)`` (0-based), so the gate
reads "batch k may be generated while the trainer is at version ``i >= k - eta``". The gate
bounds the *submission* rate, not the age of every token: a long answer admitted at version
``i`` can still be generating several versions later (its first tokens are then older than
``eta``); that is why staleness is checked a second time at consumption
(:func:`token_staleness`).

The async controller reuses these functions; the planner's simulator uses the same ones, so the
two can never disagree.
"""

from __future__ import annotations

__all__ = [
    "admission_allowed",
    "batch_index",
    "batch_range",
    "max_admitted_groups",
    "min_version_to_admit",
    "token_staleness",
]


def _check(batch_size: int, eta: int | None = None, version: int | None = None) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch size B must be a positive integer, got {batch_size!r}")
    if eta is not None and (isinstance(eta, bool) or not isinstance(eta, int) or eta < 0):
        raise ValueError(f"staleness bound eta must be an integer >= 0 or None, got {eta!r}")
    if version is not None and (
        isinstance(version, bool) or not isinstance(version, int) or version < 0
    ):
        raise ValueError(f"policy version i must be an integer >= 0, got {version!r}")


def batch_index(n: int, batch_size: int) -> int:
    """0-based training batch of the ``n``-th admitted unit (1-based): ``floor((n - 1) / B)``."""
    _check(batch_size)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"unit index N_r must be an integer >= 1, got {n!r}")
    return (n - 1) // batch_size


def admission_allowed(n_admitted: int, version: int, eta: int | None, batch_size: int) -> bool:
    """True iff the unit that would make the admitted count ``n_admitted`` may be admitted.

    ``floor((N_r - 1) / B) <= i + eta`` with ``N_r = n_admitted`` (this unit included),
    ``i = version``; ``eta = None`` admits everything.
    """
    _check(batch_size, eta, version)
    k = batch_index(n_admitted, batch_size)
    return eta is None or k <= version + eta


def max_admitted_groups(version: int, eta: int | None, batch_size: int) -> int | None:
    """Largest ``N_r`` the gate allows at version ``i``: ``(i + eta + 1) * B``.

    ``None`` when ``eta`` is ``None`` (unbounded). Example (lecture 19, exercise 2): ``B = 512``,
    ``eta = 2``, ``i = 5`` gives ``8 * 512 = 4096``: batches 1..8 (1-based) may be submitted.
    """
    _check(batch_size, eta, version)
    if eta is None:
        return None
    return (version + eta + 1) * batch_size


def min_version_to_admit(n: int, eta: int | None, batch_size: int) -> int:
    """Smallest trainer version ``i`` at which unit ``n`` (1-based) may be admitted.

    ``max(0, floor((n - 1) / B) - eta)``; 0 when ``eta`` is ``None``. Example: with ``B = 512``,
    ``eta = 2`` unit 4097 (first of the 9th batch) needs ``i = 6``.
    """
    _check(batch_size, eta)
    if eta is None:
        return 0
    return max(0, batch_index(n, batch_size) - eta)


def batch_range(k: int, batch_size: int) -> tuple[int, int]:
    """1-based inclusive unit range ``(k*B + 1, (k+1)*B)`` of 0-based batch ``k``."""
    _check(batch_size)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"batch index must be an integer >= 0, got {k!r}")
    return k * batch_size + 1, (k + 1) * batch_size


def token_staleness(trainer_version: int, token_version: int) -> int:
    """Staleness of a token trained at ``trainer_version``: ``trainer_version - token_version``.

    Raises ``ValueError`` when the token is from the future (a version-stamping bug).
    """
    s = trainer_version - token_version
    if s < 0:
        raise ValueError(
            f"token version {token_version} is newer than trainer version {trainer_version}"
        )
    return s
