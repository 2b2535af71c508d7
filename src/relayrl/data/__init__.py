"""Datasets and built-in tasks (layer 5; may import ``reward``).

- records and JSONL files (``records``, ``jsonl``);
- the prompt pipeline (``prompts``): JSONL, Parquet and saved Hugging Face datasets behind one
  loader, chat templates, tokenising with a skip report, the hold-out and the seeded per-step
  draw (``PromptSource``), built from ``cfg.data`` in one place;
- the arithmetic task (``arithmetic``);
- difficulty filtering by measured pass rate (``filtering``) and DAPO dynamic sampling
  (``dynamic``).
"""

from relayrl.data.arithmetic import ArithmeticTask
from relayrl.data.dynamic import DynamicSamplingStats, dynamic_sample, has_signal
from relayrl.data.filtering import (
    FilterReport,
    difficulty_bucket,
    filter_by_pass_rate,
    measure_pass_rates,
    run_difficulty_filter,
)
from relayrl.data.jsonl import DataError, load_sft_jsonl, write_jsonl
from relayrl.data.prompts import (
    PromptSource,
    SkipReport,
    TokenizedPrompt,
    has_chat_template,
    load_prompts,
    prompt_from_row,
    render_prompt,
    tokenize_prompts,
)
from relayrl.data.records import PromptRecord, SFTRecord

__all__ = [
    "ArithmeticTask",
    "DataError",
    "DynamicSamplingStats",
    "FilterReport",
    "PromptRecord",
    "PromptSource",
    "SFTRecord",
    "SkipReport",
    "TokenizedPrompt",
    "difficulty_bucket",
    "dynamic_sample",
    "filter_by_pass_rate",
    "has_chat_template",
    "has_signal",
    "load_prompts",
    "load_sft_jsonl",
    "measure_pass_rates",
    "prompt_from_row",
    "render_prompt",
    "run_difficulty_filter",
    "tokenize_prompts",
    "write_jsonl",
]
