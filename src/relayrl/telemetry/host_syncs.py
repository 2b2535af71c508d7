"""Counting a region's host round trips: host reads of tensor values, copies between devices,
and the synchronising CUDA calls.

- ``HostReads``: reads of a tensor's value on the host: aten's ``_local_scalar_dense``
  (``float(t)``, ``int(t)``, ``bool(t)``, ``t.item()``), a copy from another device to the host
  (``t.cpu()``), and ``Tensor.tolist`` (which dispatches nothing on a CPU tensor: wrapped while
  the counter is active), of floating-point tensors unless ``floating_only=False``. On the CPU
  this is the mirror of a GPU's device -> host syncs when integer and boolean bookkeeping
  (lengths, masks, counts) stays on the host and everything computed from a model is floating
  point.
- ``CrossDeviceCopies``: copies whose source and destination are on different devices
  (``copy_``, ``_to_copy``, ``_copy_from``, ``_copy_from_and_resize``), per (source,
  destination) device type; ``leaving(t)``: those whose source is of device type ``t``.
- ``CudaSyncs``: ``torch.cuda.set_sync_debug_mode("warn")`` while active (where CUDA is
  available): the warnings whose message contains ``match`` (default: CUDA's "called a
  synchronizing CUDA operation"), counted with the ``file:line`` of the Python call that made
  each. A C++ warning reaches Python when the outermost call into torch returns (a dispatch
  mode's own call of an op does not flush it), so it is told by that line, not by an aten op.

Each counter's ``count`` excludes what happens inside ``paused()`` (counted in
``paused_count``), e.g. an optimizer's ``step``. Not thread-safe: one thread's region.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_READ = aten._local_scalar_dense.default
# (source index, destination index) among (args..., output); -1: the output
_COPIES: dict[Any, tuple[int, int]] = {
    aten.copy_.default: (1, 0),
    aten.copy.default: (1, 0),
    aten._to_copy.default: (0, -1),
    aten._copy_from.default: (0, 1),
    aten._copy_from_and_resize.default: (0, 1),
}
CUDA_SYNC_WARNING = "synchroniz"
"""A substring of the warning ``torch.cuda.set_sync_debug_mode("warn")`` raises."""


def copy_ends(
    func: Any, args: tuple[Any, ...], out: Any
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(source, destination) of a copy op, None for any other op."""
    ends = _COPIES.get(func)
    if ends is None:
        return None
    src, dst = (out if i < 0 else args[i] for i in ends)
    if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
        return src, dst
    return None


_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def _site() -> str:
    """``dir/file.py:line`` of the nearest caller outside torch and this module."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name != __file__ and not name.startswith(_TORCH_DIR):
            p = Path(name)
            return f"{p.parent.name}/{p.name}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "?"


class _Tally:
    """``count`` outside ``paused()``, ``paused_count`` inside."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.paused_count = 0
        self._paused = False

    def _add(self, n: int = 1) -> None:
        if self._paused:
            self.paused_count += n
        else:
            self.count += n

    @contextmanager
    def paused(self) -> Iterator[None]:
        """What happens inside counts in ``paused_count``, not ``count``."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    def pause_method(self, obj: Any, name: str) -> Callable[[], None]:
        """Wrap ``obj.name`` so that its calls run ``paused()``; returns the undo."""
        method = getattr(obj, name)

        @functools.wraps(method)  # its attributes too (an LR scheduler marks the step it wraps)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.paused():
                return method(*args, **kwargs)

        own = vars(obj).get(name)
        setattr(obj, name, wrapped)

        def undo() -> None:
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)

        return undo


class HostReads(_Tally, TorchDispatchMode):
    """Host reads of tensors' values: floating-point ones unless ``floating_only=False``, of
    tensors on a ``device_type`` device if given (``"cuda"``: each read is a device -> host
    sync)."""

    def __init__(self, floating_only: bool = True, device_type: str | None = None) -> None:
        super().__init__()
        self.floating_only = floating_only
        self.device_type = device_type
        self.sites: Counter[str] = Counter()  # outside ``paused()``
        self._in_tolist = False
        self._saved: Any = None

    def _counts(self, t: torch.Tensor) -> bool:
        if self.device_type is not None and t.device.type != self.device_type:
            return False
        return t.is_floating_point() or not self.floating_only

    def _read(self) -> None:
        self._add()
        if not self._paused:
            self.sites[_site()] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self._in_tolist:
            return out
        if func is _READ:
            if self._counts(args[0]):
                self._read()
            return out
        ends = copy_ends(func, args, out)
        if ends and ends[1].device.type == "cpu" and ends[0].device.type != "cpu":
            if self._counts(ends[0]):
                self._read()
        return out

    def __enter__(self) -> HostReads:
        own = vars(torch.Tensor).get("tolist")
        original = torch.Tensor.tolist
        self._saved = own

        def tolist(t: torch.Tensor) -> Any:
            if self._in_tolist:
                return original(t)
            if self._counts(t):
                self._read()
            self._in_tolist = True  # a device tensor's copy to the host is this same read
            try:
                return original(t)
            finally:
                self._in_tolist = False

        torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self._saved is None:
            del torch.Tensor.tolist
        else:
            torch.Tensor.tolist = self._saved  # type: ignore[method-assign]


class CrossDeviceCopies(_Tally, TorchDispatchMode):
    """Copies between two different devices, per (source, destination) device type."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        ends = copy_ends(func, args, out)
        if ends and ends[0].device != ends[1].device:
            self.pairs[(ends[0].device.type, ends[1].device.type)] += 1
            self._add()
        return out

    def leaving(self, device_type: str) -> int:
        """Copies from a ``device_type`` device to another device."""
        return sum(n for (s, d), n in self.pairs.items() if s == device_type and d != device_type)

    def by_pair(self) -> dict[str, int]:
        return {f"{s}->{d}": n for (s, d), n in sorted(self.pairs.items())}


class CudaSyncs(_Tally):
    """The warnings containing ``match`` raised while active, by the ``file:line`` of the call
    that made each; ``debug_mode``: ``torch.cuda.set_sync_debug_mode("warn")`` meanwhile (where
    CUDA is available)."""

    def __init__(self, match: str = CUDA_SYNC_WARNING, debug_mode: bool = True) -> None:
        super().__init__()
        self.match = match
        self.debug_mode = debug_mode and torch.cuda.is_available()
        self.sites: Counter[str] = Counter()
        self._log: list[warnings.WarningMessage] = []
        self._catch: Any = None
        self._before: int | None = None

    def _drain(self) -> None:
        """Count the matching warnings logged since the last look (the log emptied)."""
        for w in self._log:
            if self.match in str(w.message):
                self._add()
                if not self._paused:
                    p = Path(w.filename)
                    self.sites[f"{p.parent.name}/{p.name}:{w.lineno}"] += 1
        del self._log[:]

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._drain()
        with super().paused():
            try:
                yield
            finally:
                self._drain()

    def __enter__(self) -> CudaSyncs:
        self._catch = warnings.catch_warnings(record=True)
        self._log = self._catch.__enter__()
        warnings.simplefilter("always")
        if self.debug_mode:
            self._before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._before is not None:
                torch.cuda.set_sync_debug_mode(self._before)
            self._drain()
        finally:
            self._catch.__exit__(*exc)

    def summary(self) -> dict[str, Any]:
        """The count, the paused count, the top sites."""
        return {
            "count": self.count,
            "paused": self.paused_count,
            "sites": dict(self.sites.most_common(12)),
        }
