"""Shared test set-up: offline hub, one torch thread per process (2-core machines), and the
seed of the learning tests.

``RELAYRL_TEST_SEED=s`` (default 0) builds the SFT fixture and runs every RL test with seed
``s``; ``RELAYRL_OUTCOMES=file.jsonl`` makes the learning tests append what they measured
(the ``outcome`` fixture). The min / median quoted in their docstrings come from
``RELAYRL_TEST_SEED=0..4 pytest -m learning`` on this machine.
"""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402

from helpers import TEST_SEED  # noqa: E402


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama warm-started by SFT on arithmetic to a validation pass-rate target, shared
    by the integration tests."""
    from helpers import make_sft_model

    return make_sft_model(tmp_path_factory.mktemp("sft_model"), seed=TEST_SEED)


@pytest.fixture
def outcome(request: pytest.FixtureRequest):
    """``outcome(name=value, ...)``: record a learning test's measured figures (to the JSONL
    file named by ``RELAYRL_OUTCOMES``, one line per call, with the test id and seed)."""
    path = os.environ.get("RELAYRL_OUTCOMES")

    def record(**values: float) -> None:
        if path:
            row = {"test": request.node.nodeid, "seed": TEST_SEED, **values}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    return record


# ``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadfile
# --no-loadscope-reorder``) with the scheduler below: each worker takes whole groups, one group
# per test module (module fixtures are built once), except the modules below that must not run
# beside each other (two Ray clusters on one machine: a plain ``ray.init()`` can join the other;
# the sandbox tests compare the host's System V IPC objects and mounts before and after). Heavy
# groups go first so that neither worker is left with a long one at the end (seconds measured
# on 2 busy cores, session 4: ray 383, train_integration 337, async 325, rlhf_lab 275). (xdist's
# own ``--dist loadgroup`` does not group under pytest 9.2: it renames ``item._nodeid``, which
# pytest 9 no longer reads.)
_SHARED_GROUPS = {
    "test_ray_backend": "ray",
    "test_ray_train": "ray",
    "test_ray_multinode": "ray",
    "test_fsdp_train": "ray",
    "test_launch_ranks": "ray",  # a simulated two-node cluster (ray.cluster_utils.Cluster)
    "test_vllm_backend": "ray",
    "test_vllm_backend_weights": "ray",
    "test_vllm_backend_trainer": "ray",
    "test_vllm_backend_ray": "ray",
    "test_vllm_server": "ray",
    "test_vllm_sync_failures": "ray",
    "test_vllm_stream": "ray",
    "test_sandbox": "sandbox",
    "test_code_attacks": "sandbox",
    "test_models_fetch": "smollm2",  # one worker converts the cached model (issue 38)
    "test_smollm2_grpo": "smollm2",
}
_HEAVY_FIRST = [
    "ray",
    "test_train_integration",
    "test_async_integration",
    "test_rlhf_lab",
    "test_faults",
    "test_agent_rollout",
    "sandbox",
    "test_run_dir",
    "test_fsdp",
    "test_world_size_invariance",
]


def _group(nodeid: str) -> str:
    """A test's scheduling group: its module's stem, or the shared group of that module."""
    module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return _SHARED_GROUPS.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the heavy groups first; within a group the collection order is kept."""
    rank = {g: i for i, g in enumerate(_HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(_group(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Whole groups (``_group``) per worker, in collection order (``--no-loadscope-reorder``)."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return GroupScheduling(config, log)
