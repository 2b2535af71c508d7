"""The CPU fast path of the own engine: C kernels for float32 decode steps on the CPU.

``varlen_decode.c`` (decode attention over each row's own cache length) and ``step_kernels.c``
(a layer's rotary, cache write and attention in one call, the residual add with RMSNorm, the
sampler's draw), compiled once per machine by ``build`` and called through ``ctypes`` from
``varlen_decode``. The engine uses them only in float32 on the CPU and only where they build
(``available()``); ``RELAYRL_VARLEN_DECODE=0`` turns them off, and every path without them
(SDPA, the module forward, CUDA) gives results equal to float32 rounding. Why they are kept,
with the figures: docs/measurements.md ("The CPU fast path"). They are not tuned further: the
engine's speed that matters is on the GPU, and CPU users who need speed have vLLM-CPU.
"""
