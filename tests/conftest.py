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
