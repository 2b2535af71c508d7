"""The prompt pipeline: from ``cfg.data`` to each step's token ids and the eval set.

The controller builds one ``PromptSource(cfg.data, tokenizer, seed)`` and asks it for a step's
prompts (``for_step(step, n)``) and the eval set (``eval_set()``). Each job has one module and
one function:

1. where the prompts come from: ``tasks.open_task`` reads ``data.task`` (a dataset or a
   generated task; the one place a new source is added);
2. reading: ``read.load_prompts`` (JSONL, Parquet, a saved Hugging Face dataset; every row
   checked, records built when drawn), over ``arrow`` for the Arrow forms;
3. templating: ``template.render_prompt`` (the tokenizer's chat template, a system prompt);
4. tokenising and the length filter: ``tokens.encode_prompts`` and ``SkipReport.note``, put
   together by ``tokens.RowCache`` (a row tokenised when first drawn) and
   ``tokens.tokenize_prompts`` (a list, all at once);
5. the hold-out: ``hold_out.hold_out_rows`` (the eval set drawn out of a dataset's rows);
6. the seeded per-step draw and the eval set: ``source.PromptSource``.
"""

from relayrl.data.prompts.read import PromptRows, load_prompts, prompt_from_row
from relayrl.data.prompts.source import PromptSource
from relayrl.data.prompts.tasks import DatasetTask, GeneratedTask, arithmetic_task, open_task
from relayrl.data.prompts.template import has_chat_template, render_prompt
from relayrl.data.prompts.tokens import (
    RowCache,
    SkipReport,
    TokenizedPrompt,
    encode_prompts,
    tokenize_prompts,
)

__all__ = [
    "DatasetTask",
    "GeneratedTask",
    "PromptRows",
    "PromptSource",
    "RowCache",
    "SkipReport",
    "TokenizedPrompt",
    "arithmetic_task",
    "encode_prompts",
    "has_chat_template",
    "load_prompts",
    "open_task",
    "prompt_from_row",
    "render_prompt",
    "tokenize_prompts",
]
