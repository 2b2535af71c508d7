"""The host round-trip counters (``relayrl.telemetry.host_syncs``) count what they name, and
nothing else: a deliberate host read, a deliberate copy between devices, a deliberate warning
raised inside an op (the mechanism ``CudaSyncs`` counts CUDA's synchronising calls with)."""

from __future__ import annotations

from pathlib import Path

import torch

from relayrl.telemetry.host_syncs import CrossDeviceCopies, CudaSyncs, HostReads

HERE = f"{Path(__file__).parent.name}/{Path(__file__).name}"


def test_host_reads_count_float_reads_and_set_paused_ones_apart():
    x = torch.randn(4)
    with HostReads() as reads:
        float(x.sum())  # counted: a floating-point value read on the host
        int(torch.arange(3).sum())  # not: an integer
        bool(x.sum() > 0)  # not: a boolean
        x.tolist()  # counted: tolist dispatches nothing on a CPU tensor, wrapped meanwhile
        with reads.paused():
            x.max().item()
    assert (reads.count, reads.paused_count) == (2, 1)
    assert sum(reads.sites.values()) == 2 and all(s.startswith(HERE) for s in reads.sites)
    assert "tolist" not in vars(torch.Tensor)  # unwrapped on exit
    with HostReads(floating_only=False) as every:
        int(torch.arange(3).sum())
        bool(x.sum() > 0)
    assert every.count == 2
    with HostReads(device_type="cuda") as on_gpu:  # reads of CPU tensors: not device reads
        float(x.sum())
        x.tolist()
    assert on_gpu.count == 0


def test_pause_method_pauses_and_undoes():
    x = torch.randn(3)

    class Stepper:
        def step(self) -> float:
            return x.sum().item()

    s = Stepper()
    reads = HostReads()
    undo = reads.pause_method(s, "step")
    with reads:
        s.step()
        x.sum().item()
    undo()
    assert (reads.count, reads.paused_count) == (1, 1)
    assert "step" not in vars(s)


def test_cross_device_copies_count_copies_between_devices_only():
    x = torch.randn(4)
    with CrossDeviceCopies() as copies:
        x.clone()
        x.to(torch.float64)  # same device: not counted
        torch.empty(4).copy_(x)
        x.to("meta")  # counted: cpu -> meta (_to_copy)
        torch.empty(4, device="meta").copy_(x)  # counted: cpu -> meta (copy_)
    assert copies.count == 2 and copies.by_pair() == {"cpu->meta": 2}
    assert copies.leaving("cpu") == 2 and copies.leaving("meta") == 0


def test_cuda_syncs_count_warnings_raised_inside_ops():
    # CUDA's synchronising-call warning is a C++ warning raised inside an op; on the CPU,
    # copy_'s complex -> real warning is one too (every time under set_warn_always)
    before = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        z = torch.zeros(3)
        with CudaSyncs(match="Casting complex values") as syncs:
            z.copy_(torch.ones(3, dtype=torch.complex64))
            z.add_(1.0)  # no warning
            with syncs.paused():
                z.copy_(torch.ones(3, dtype=torch.complex64))
    finally:
        torch.set_warn_always(before)
    assert (syncs.count, syncs.paused_count) == (1, 1)
    assert list(syncs.sites) and all(s.startswith(HERE) for s in syncs.sites)
    assert syncs.summary()["count"] == 1
