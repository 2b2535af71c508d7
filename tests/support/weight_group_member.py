"""A weight-group member in a process of its own, for the bounded-failure tests of
``tests/integration/test_weight_sync_bounds.py``:
``python weight_group_member.py PORT RANK WORLD MODE
TIMEOUT_S``. It prints ``ready`` once imported (the test then starts its own member), joins
generation 0 of the group, prints ``joined``, then by ``MODE``:

- ``hang``: takes part in nothing (sleeps): a peer's next broadcast times out;
- ``send_hang``: (rank 0) broadcasts the manifest of version 9 (one bucket of 64 float32),
  then sleeps: a receiver waits for the bucket until its timeout.
"""

from __future__ import annotations

import sys
import time

import torch

from relayrl.cluster.weight_collective import Entry, WeightGroup, plan_buckets


def main() -> None:
    port, rank, world, mode, timeout_s = sys.argv[1:6]
    print("ready", flush=True)
    group = WeightGroup("127.0.0.1", int(port), int(rank), int(world), "gloo", float(timeout_s))
    print("joined", flush=True)
    if mode == "send_hang":
        group.send_manifest(9, plan_buckets([Entry("w", (64,), torch.float32)], 1 << 20))
    time.sleep(600)


if __name__ == "__main__":
    main()
