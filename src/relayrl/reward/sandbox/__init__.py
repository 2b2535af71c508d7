"""The code sandbox: model-written programs in a fresh, contained process, and the harness
whose verdict the program under test cannot reach.

- ``api``: ``Sandbox`` / ``run_python``, the isolation modes and their probe;
- ``run``: one run (the boot and runner scripts, limits, pipes, the kill);
- ``boot`` / ``runner``: the scripts that run inside the sandbox (``python -I``), never imported;
- ``os_limits``: processes of a session or a uid, rlimits, the OS probes;
- ``code_harness``: tests run beside the program, their verdict on a channel it cannot write.
"""

from relayrl.reward.sandbox.api import (
    BOOT_FAILED,
    CHANNEL_BYTES,
    IsolationMode,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    detect_isolation,
    processes_of_session,
    processes_of_uid,
    remove_orphaned_dirs,
    run_python,
)

__all__ = [
    "BOOT_FAILED",
    "CHANNEL_BYTES",
    "IsolationMode",
    "Sandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxStatus",
    "detect_isolation",
    "processes_of_session",
    "processes_of_uid",
    "remove_orphaned_dirs",
    "run_python",
]
