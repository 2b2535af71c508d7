"""Datasets and built-in tasks (layer 5; may import ``reward``).

- records and JSONL files (``records``, ``jsonl``); JSONL, Parquet and saved Hugging Face
  datasets behind one loader (``sources``); chat templates and tokenisation with a skip
  report (``prompting``);
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
from relayrl.data.jsonl import DataError, load_prompts_jsonl, load_sft_jsonl, write_jsonl
from relayrl.data.prompting import SkipReport, has_chat_template, render_prompt, tokenize_prompts
from relayrl.data.records import PromptRecord, SFTRecord
from relayrl.data.sources import load_prompt_dataset, prompt_from_row

__all__ = [
    "ArithmeticTask",
    "DataError",
    "DynamicSamplingStats",
    "FilterReport",
    "PromptRecord",
    "SFTRecord",
    "SkipReport",
    "difficulty_bucket",
    "dynamic_sample",
    "filter_by_pass_rate",
    "has_chat_template",
    "has_signal",
    "load_prompt_dataset",
    "load_prompts_jsonl",
    "load_sft_jsonl",
    "measure_pass_rates",
    "prompt_from_row",
    "render_prompt",
    "run_difficulty_filter",
    "tokenize_prompts",
    "write_jsonl",
]
