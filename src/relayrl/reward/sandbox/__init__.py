"""The code sandbox: model-written programs in a fresh, contained process, and the harness
whose verdict the program under test cannot reach.

- ``api``: ``Sandbox`` / ``run_python``, the isolation modes and their probe;
- ``run``: one run (the boot and runner scripts, limits, pipes, the kill);
- ``boot`` / ``runner``: the scripts that run inside the sandbox (``python -I``), never imported;
- ``os_limits``: processes of a session or a uid, rlimits, the OS probes;
- ``code_harness``: tests run beside the program, their verdict on a channel it cannot write.
"""

from relayrl.reward.sandbox.api import *  # noqa: F403  (its public names, ``__all__``)
from relayrl.reward.sandbox.api import __all__ as __all__
