"""Datasets and built-in tasks (DESIGN.md layer 5; may import ``reward``)."""

from relayrl.data.arithmetic import ArithmeticTask
from relayrl.data.jsonl import DataError, load_prompts_jsonl, load_sft_jsonl, write_jsonl
from relayrl.data.records import PromptRecord, SFTRecord

__all__ = [
    "ArithmeticTask",
    "DataError",
    "PromptRecord",
    "SFTRecord",
    "load_prompts_jsonl",
    "load_sft_jsonl",
    "write_jsonl",
]
