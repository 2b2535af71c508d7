"""Shared test set-up: offline hub, one torch thread per process (2-core machines)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Llama warm-started by SFT on arithmetic, shared by the integration tests."""
    from helpers import make_sft_model

    return make_sft_model(tmp_path_factory.mktemp("sft_model"))
