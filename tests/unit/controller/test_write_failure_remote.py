"""``write_failure`` of an error raised in a Ray worker (a sharded role's rank writing its part
of a checkpoint): the cause in words, from the worker's exception, not the traceback text."""

from __future__ import annotations

import errno

from relayrl.controller.checkpoint import write_failure
from relayrl.workers.fsdp import ShardedWriteError


class RemoteError(OSError):
    """What ``ray.get`` raises for a task's OSError: an instance of the cause's class whose
    text is the worker's traceback and whose ``cause`` is the worker's exception."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::RoleHost.call()\n  File ...\n{cause!r}")
        self.cause = cause


def test_a_remote_sharded_write_error_is_its_one_line(tmp_path):
    why = "rank 1 could not write its part of sharded_actor: No space left on device"
    remote = RemoteError(ShardedWriteError(errno.ENOSPC, why))
    assert write_failure(remote, tmp_path) == why


def test_a_remote_error_that_is_no_write_fault_is_none(tmp_path):
    assert write_failure(RemoteError(ValueError("bad shape")), tmp_path) is None
