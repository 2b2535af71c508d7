"""Metrics (JSONL + TensorBoard), progress bars and run summaries (a leaf layer).

A utility layer: it imports only the standard library, numpy, rich and torch/tensorboard,
never the controller or other relayrl layers.
"""

from relayrl.telemetry.metrics import METRICS_FILE, MetricsLogger, read_metrics
from relayrl.telemetry.progress import StepProgress, format_fields
from relayrl.telemetry.summary import print_summary, summarize, summary_table

__all__ = [
    "METRICS_FILE",
    "MetricsLogger",
    "StepProgress",
    "format_fields",
    "print_summary",
    "read_metrics",
    "summarize",
    "summary_table",
]
