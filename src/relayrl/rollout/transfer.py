"""Host <-> device moves of the engine's per-step data, and where the engine computes.

The engine keeps its bookkeeping (lengths, slot tables, token lists) in Python and builds each
step's small index / position / mask tensors from it on the model's device. On CUDA a plain
``torch.tensor(values, device="cuda")`` is a blocking copy: it waits for every kernel queued
before it (a host <-> device sync per tensor, several per step). :func:`device_tensor` builds
the tensor on the host and copies it with ``non_blocking=True`` instead: CUDA stages pageable
host memory before the call returns (so the host list may go at once) and the copy is ordered
on the stream like a kernel, with no wait. The one transfer back per step, the sampled tokens
and their logprobs, is :func:`to_host` (one device -> host copy, the only sync of a step).

Every tensor is created with an explicit ``device=`` (host ones on ``CPU``), never on torch's
default device: inside ``with torch.device("meta"):`` (or a CUDA default) the engine computes
where its model is, as it does outside (tests/unit/rollout/test_engine_device.py).
"""

from __future__ import annotations

import array
import itertools
import weakref
from collections.abc import Sequence

import torch
from torch import Tensor

CPU = torch.device("cpu")


def device_tensor(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``values`` (numbers or nested lists of them) as a ``dtype`` tensor on ``device``:
    built on the host, then one non-blocking copy (no stream sync on CUDA)."""
    t = torch.tensor(values, dtype=dtype, device=CPU)
    if device.type == "cpu":
        return t
    return t.to(device, non_blocking=True)


def device_rows(rows: Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """Equal-length rows of Python ints as one int64 ``[len(rows), len(rows[0])]`` tensor on
    ``device``, like ``device_tensor(rows, torch.long, device)``: the host tensor wraps an
    ``array`` the rows were copied into (``torch.frombuffer``), without ``torch.tensor``'s
    walk over nested lists (~40% less time for a step's few rows of 32)."""
    width = len(rows[0]) if rows else 0
    if width == 0 or any(len(r) != width for r in rows):
        return device_tensor(rows, torch.long, device)  # empty or ragged: its error, if any
    flat = array.array("q")
    for row in rows:
        flat.extend(row)
    t = torch.frombuffer(flat, dtype=torch.int64).view(len(rows), width)
    if device.type == "cpu":
        return t
    return t.to(device, non_blocking=True)


def to_host(tokens: Tensor, logprobs: Tensor, vocab: int) -> tuple[list[int], list[float]]:
    """Sampled ``tokens`` (int64 ``[n]`` or ``[n, 1]``, ids < ``vocab``) and their
    ``logprobs`` (fp32, the same shape) as Python lists in ONE device -> host transfer: the
    rows of one ``[2, n]`` float tensor, fp32 while ``vocab <= 2^24`` (every id below 2^24 is
    an fp32 number), else float64. Exact: the logprobs keep their own dtype (or widen), and
    ``tolist`` gives the same Python floats as of the logprobs alone."""
    ids = torch.float32 if vocab <= _FP32_EXACT_INTS else torch.float64
    dtype = torch.promote_types(ids, logprobs.dtype)  # float64 logprobs stay float64
    both = torch.stack((tokens.to(dtype), logprobs.to(dtype))).view(2, -1).tolist()
    return list(map(int, both[0])), both[1]


_FP32_EXACT_INTS = 1 << 24


def model_device(model: torch.nn.Module, device: torch.device | str | None = None) -> torch.device:
    """The one device of all the model's parameters and buffers (CPU when it has none).

    ``device`` (optional) must agree with it: ``cuda`` matches any CUDA index, ``cuda:1`` only
    index 1. Raises ``ValueError`` on a model spread over several devices or on a mismatch.
    """
    found = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    if len(found) > 1:
        names = ", ".join(sorted(str(d) for d in found))
        raise ValueError(
            f"the rollout engine's model is spread over several devices ({names}); "
            "move it to one (model.to(device))"
        )
    here = found.pop() if found else CPU
    if device is not None:
        want = torch.device(device)
        if want.type != here.type or (want.index is not None and want.index != here.index):
            raise ValueError(
                f"RolloutEngine(device={str(want)!r}) but the model's parameters are on "
                f"{here}: move the model there first (model.to({str(want)!r}))"
            )
    return here


def select_slots(slots: list[int], device: torch.device) -> Tensor | slice:
    """Arena rows of sorted distinct ``slots``: a slice (a view) when contiguous."""
    if slots[-1] - slots[0] + 1 == len(slots):
        return slice(slots[0], slots[-1] + 1)
    return device_tensor(slots, torch.long, device)


_FIRST_PARAM: weakref.WeakKeyDictionary[torch.nn.Module, torch.nn.Parameter] = (
    weakref.WeakKeyDictionary()
)


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's first parameter (the object found once per model: ``.to()``
    and ``load_state_dict`` change its data in place, not the object)."""
    p = _FIRST_PARAM.get(model)
    if p is None:
        p = _FIRST_PARAM[model] = next(model.parameters())
    return p.dtype
