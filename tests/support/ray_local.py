"""A Ray cluster of the test's own on this machine (``ray.init(address="local")``): 2 CPUs, no
dashboard, the workers' logs not forwarded. ``address="local"`` starts a new cluster even when
another one runs here (a plain ``ray.init()`` would join the newest one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def ray_local(
    num_cpus: int = 2,
    num_gpus: int | None = None,
    runtime_env: dict[str, Any] | None = None,
    log_to_driver: bool = False,
) -> Iterator[None]:
    """Start a local Ray cluster (after shutting down any this process is connected to) and
    shut it down on leaving. ``num_gpus`` / ``runtime_env``: passed to ``ray.init`` when given.

    A module-scoped fixture: ``with ray_local(): yield``; one test: ``with ray_local(): ...``.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    extra: dict[str, Any] = {}
    if num_gpus is not None:
        extra["num_gpus"] = num_gpus
    if runtime_env is not None:
        extra["runtime_env"] = runtime_env
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=log_to_driver,
        **extra,
    )
    try:
        yield
    finally:
        ray.shutdown()
