"""The trainers' attention masks (``relayrl.model.attention_masks``): a padded batch gets the
4D mask transformers would build, without transformers' read of the padding mask."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config
from transformers.masking_utils import create_causal_mask

from relayrl.model import build_tiny_model, forward_logprobs, pack_batch
from relayrl.model.attention_masks import full_mask, host_padding, one_mask_for_all_layers
from relayrl.model.batching import _model_inputs
from relayrl.telemetry.host_syncs import HostReads
from relayrl.workers.experience import Experience

MASKING = "transformers/masking_utils.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("masks") / "m", hidden_size=16)


def _model(model_dir, attn: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn).eval()


PADDED = ([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]])  # left and right padding
FULL = ([[5, 6, 7], [8, 9, 4]], [[10, 11], [12, 13]])


def test_host_padding_reads_only_the_host():
    m = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert host_padding(m) is True
    assert host_padding(torch.ones(2, 3, dtype=torch.long)) is False
    assert host_padding(m, known=False) is False  # recorded wins
    assert host_padding(m.to("meta")) is None  # on a device: not read


def test_one_mask_for_all_layers():
    assert one_mask_for_all_layers(LlamaConfig())
    assert not one_mask_for_all_layers(MistralConfig(sliding_window=4096))
    assert one_mask_for_all_layers(Qwen2Config(use_sliding_window=False, num_hidden_layers=2))
    windows = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    windows.num_hidden_layers = 2
    assert "sliding_attention" in windows.layer_types
    assert not one_mask_for_all_layers(windows)


def test_full_mask_is_the_mask_transformers_builds(model_dir):
    model = _model(model_dir, "sdpa")
    batch = pack_batch(*PADDED, pad_id=0)
    embeds = model.get_input_embeddings()(batch.input_ids)
    theirs = create_causal_mask(
        model.config, embeds, batch.attention_mask, None, position_ids=batch.position_ids
    )
    mine = full_mask(model, batch.attention_mask)
    assert mine.shape == (2, 1, 6, 6) and mine.dtype == torch.bool
    assert torch.equal(mine, theirs)
    # row 1 (prompt [8, 9] left-padded by one): key 0 is never attended, key 1 from query 1 on
    assert not mine[1, 0, :, 0].any() and mine[1, 0, 1:, 1].all() and not mine[1, 0, 0, 1]


def test_eager_and_sliding_window_models_keep_the_2d_mask(model_dir):
    batch = pack_batch(*PADDED, pad_id=0)
    assert full_mask(_model(model_dir, "eager"), batch.attention_mask) is batch.attention_mask
    model = _model(model_dir, "sdpa")
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    assert full_mask(model, batch.attention_mask) is batch.attention_mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_padded_forward_reads_no_mask_and_gives_the_same_logits(model_dir, attn):
    """The logits are bitwise those of the 2D mask (which transformers turns into the same 4D
    mask); a padded batch costs no read in transformers' masking (two before: its
    ``sum() == numel()`` checks), an unpadded one keeps its one read (SDPA's is_causal)."""
    model = _model(model_dir, attn)
    for prompts_responses, mask_reads in ((PADDED, 0), (FULL, int(attn == "sdpa"))):
        batch = pack_batch(*prompts_responses, pad_id=0)
        with HostReads(floating_only=False) as reads, torch.no_grad():
            forward_logprobs(model, batch)
        assert sum(n for s, n in reads.sites.items() if s.startswith(MASKING)) == mask_reads
        with torch.no_grad():
            mine = model(**_model_inputs(model, batch), use_cache=False).logits
            plain = {"attention_mask": batch.attention_mask, "position_ids": batch.position_ids}
            theirs = model(input_ids=batch.input_ids, **plain, use_cache=False).logits
        assert torch.equal(mine, theirs)


def test_moving_an_experience_records_its_padding():
    exp = Experience(pack_batch(*PADDED, pad_id=0))
    moved = exp.to(torch.device("meta"))
    assert moved.batch.padded is True and moved.batch.has_padding() is True
    full = Experience(pack_batch(*FULL, pad_id=0)).to(torch.device("meta"))
    assert full.batch.has_padding() is False
    assert moved.select([0]).batch.has_padding() is None  # not known once cut on the device
