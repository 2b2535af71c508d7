"""The ``monitor`` section: proxy-vs-gold monitoring."""

from __future__ import annotations

from relayrl.config.base import (
    _Strict,
)


class MonitorConfig(_Strict):
    gold_fn: str | None = None
    """A gold / held-out scorer (reward function spec) evaluated on every step's samples to
    log proxy-vs-gold divergence (``monitor/*``); KL and distinct-n are logged regardless."""
