"""Training memory of one trainer rank: a two-phase model of an actor update.

An optimizer step's peak is the larger of two phases (bytes; ``N`` parameters, ``N_t`` of them
trained, hidden ``h``, ``L`` layers, vocabulary ``V``, ``T`` tokens per micro-batch of which a
share ``r`` are response tokens, FSDP2 over ``dp`` ranks, ``b_c`` bytes of the compute dtype: 4
fp32, 2 under bf16 mixed precision)::

    peak = max(backward, optimizer)

    backward  = max(loss, embedding)                     (the backward of a later micro-batch:
                                                          the gradients of the earlier ones held)
    loss      = W + G + S + B16 + A + X + F + C          (its start, the loss's backward: every
                                                          activation and logit buffer alive)
    embedding = W + G + S + D + C                        (its end: the embedding's gradient)
    optimizer = W + G + S + U + C                        (AdamW's step)

    W   = 4 N / dp                  fp32 (master) weights
    G   = 4 N_t / dp                fp32 gradients
    S   = 8 N_t / dp                AdamW m and v (there from step 1 on)
    B16 = 2 N                       [bf16, no FSDP] the autocast bf16 weight copies the backward
                                    keeps; with checkpointing 2 (V h + P_l) (lm_head + one
                                    recomputed layer); 0 in fp32
    A   = T h (a L + a0)            activations kept for the backward, ``a`` = ``a_fp32`` or
                                    ``a_bf16`` bytes per token, layer and hidden unit, ``a0``
                                    those outside the layers (embedding output, final norm,
                                    lm_head input);
        = T h (k L + a0)            with checkpointing: ``k`` per layer (its kept input; the
                                    recomputation of a layer comes later in the backward, when
                                    the logit buffers are gone)
    X   = K V b_c + v r T V         the lm_head's logits of the ``K`` positions it runs on
                                    (compute dtype) and ``v`` bytes per response token and
                                    vocabulary entry of fp32 logprob / entropy buffers (the fp32
                                    upcast), computed over the whole micro-batch at once;
        = K V b_c + x r T V         logprobs and entropy in chunks of positions, the entropy's
                                    softmax recomputed in the backward
                                    (``relayrl.model.forward_logprobs``): ``x`` =
                                    ``CHUNKED_LOGIT_BYTES`` per response token and vocabulary
                                    entry (the contiguous fp32 copies of the response logits and
                                    the gradient accumulated over the chunks)
    K   = k T                       ``k`` = 1: the head on every position; with
                                    ``logits_to_keep = R + 1`` (the trainer's forward),
                                    ``k = (R + 1) / (P + R)``
    F   = 2 P_l b_c + 4 P_l         [FSDP, dp > 1, in the backward] two gathered layers
                                    (prefetch) and one unsharded layer gradient; replaces B16
    D   = 16 V h                    [the embedding trains] four fp32 ``V h`` buffers at the
                                    embedding's backward (its dense gradient, the tied
                                    lm_head's, their sum; the measured multiple of ``4 V h``:
                                    docs/measurements.md); FSDP adds the gathered root
                                    ``V h b_c``; 0 under LoRA
    U   = 8 P_max / dp              single-tensor AdamW (torch's CPU default): ``sqrt(v)`` and
                                    the denominator of the largest trained tensor ``P_max``;
        = 4 N_t / dp                foreach AdamW (torch's CUDA default): ``sqrt(v)`` of all;
        = 0                         fused AdamW
    C   = overhead                  fixed runtime bytes

with ``P_l = (N - V h) / L`` parameters per layer. LoRA: ``N_t`` is the adapters and
``P_max`` the largest adapter. Six coefficients are fitted (:class:`TrainMemoryModel`:
``a_fp32``, ``a_bf16``, ``k_ckpt``, ``a0``, ``v`` and ``overhead``), ``x`` is measured on
one model (``CHUNKED_LOGIT_BYTES``: the fit's rows predate chunking), everything else is
counted. Tensor and pipeline parallelism are the caller's: pass the per-rank ``N / (tp pp)``,
``h / tp``, ``L / pp``, ``V / tp``. With a single micro-batch per optimizer step the gradients
only build up during the backward, so the full ``G`` is an upper bound there. Not modelled: an
attention-score term (the fit ran SDPA on 64-token rows; eager attention at long sequences
keeps ``heads x seq`` per token and layer) and the recomputation point under checkpointing.

Measured quantity (``bench/scale.py --memory``): the live bytes of torch's CPU allocator (the
profiler's memory events, every allocation and free) at each phase's peak, in the second step
of an update (Adam state present, the gradients of an earlier micro-batch held), one fresh
process per (model, configuration). On a GPU the caching allocator rounds blocks and CUDA /
NCCL hold their own buffers (``memory_fraction`` leaves room for those): the coefficients are
this CPU's until the GPU check measures them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import numpy as np

MB = float(2**20)
Optimizer = Literal["single", "foreach", "fused"]


@dataclass(frozen=True)
class TrainShape:
    """One rank's share of an actor update (module docstring for the symbols).

    Attributes:
        params: ``N``, parameters on this rank before FSDP sharding.
        trainable: ``N_t`` (LoRA: the adapters).
        hidden, layers, vocab: ``h``, ``L``, ``V``.
        tokens: ``T``, tokens (every position) of one micro-batch.
        response_share: ``r``, the share of them whose logprobs are computed.
        bf16: bf16 mixed precision (fp32 master weights, bf16 autocast).
        checkpointing: activation checkpointing of every decoder layer.
        lora: only adapters train (the lm_head has no gradient).
        dp: FSDP2 ranks (1: not sharded).
        optimizer: AdamW implementation (``single``: torch's CPU default; ``foreach``: CUDA's).
        largest_trained: ``P_max`` (default ``E``, the tied embedding / lm_head; LoRA: 0).
        embedding_params: ``E``, this rank's embedding / lm_head parameters (default ``V h``;
            under tensor parallelism ``V h / tp`` while ``hidden`` is ``h / tp``). Where the
            module docstring writes ``V h`` it means ``E``.
        logits_kept: ``k``, the share of the ``T`` positions the lm_head runs on (1: all, a
            forward without ``logits_to_keep``; ``(R + 1) / (P + R)`` with it).
        chunked_logprobs: logprobs and entropy in chunks (``x`` instead of the fitted ``v``).
    """

    params: float
    trainable: float
    hidden: int
    layers: int
    vocab: int
    tokens: int
    response_share: float = 1.0
    bf16: bool = False
    checkpointing: bool = False
    lora: bool = False
    dp: int = 1
    optimizer: Optimizer = "single"
    largest_trained: float | None = None
    embedding_params: float | None = None
    logits_kept: float = 1.0
    chunked_logprobs: bool = False

    def __post_init__(self) -> None:
        for f in ("hidden", "layers", "vocab", "dp"):
            if getattr(self, f) < 1:
                raise ValueError(f"TrainShape: {f} must be >= 1, got {getattr(self, f)}")
        if self.tokens < 0 or self.params <= 0 or not 0 <= self.trainable <= self.params:
            raise ValueError("TrainShape: need tokens >= 0, params > 0, 0 <= trainable <= params")
        if not 0.0 <= self.response_share <= 1.0:
            raise ValueError(f"TrainShape: response_share {self.response_share} not in [0, 1]")
        if self.optimizer not in ("single", "foreach", "fused"):
            raise ValueError(f"TrainShape: unknown optimizer {self.optimizer!r}")
        if not 0.0 < self.logits_kept <= 1.0:
            raise ValueError(f"TrainShape: logits_kept {self.logits_kept} not in (0, 1]")

    @property
    def embedding(self) -> float:
        """``E`` (default ``V h``)."""
        if self.embedding_params is not None:
            return self.embedding_params
        return float(self.vocab * self.hidden)

    @property
    def layer_params(self) -> float:
        """``P_l = (N - E) / L`` (clamped at 0)."""
        return max(self.params - self.embedding, 0.0) / self.layers

    @property
    def compute_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def p_max(self) -> float:
        if self.largest_trained is not None:
            return self.largest_trained
        return self.embedding if not self.lora else 0.0


CHUNKED_LOGIT_BYTES = 10.6
"""``x``: bytes per response token and vocabulary entry of the chunked logprob / entropy
computation at the loss point's peak (fp32; measured on SmolLM2-135M-Instruct, LoRA, rows of
16 + 64 against 64 + 16 tokens: the difference of the allocator peaks less the difference of
``K V 4``, over the difference of ``r T V``; ``bench/smollm2_memory.py``)."""


@dataclass(frozen=True)
class TrainMemoryModel:
    """The fitted coefficients of the two-phase model (module docstring)."""

    a_fp32: float
    """Activation bytes per token, layer and hidden unit, fp32."""
    a_bf16: float
    """The same under bf16 autocast."""
    k_ckpt: float
    """Bytes per token, layer and hidden unit kept under activation checkpointing."""
    a0: float
    """Activation bytes per token and hidden unit outside the decoder layers."""
    v: float
    """fp32 logprob / entropy bytes per response token and vocabulary entry."""
    overhead: float
    """Fixed runtime bytes."""

    def terms(self, s: TrainShape) -> dict[str, float]:
        """Every term of both phases, bytes (names as in the module docstring)."""
        n, nt, dp, h, L, T = s.params, s.trainable, s.dp, s.hidden, s.layers, s.tokens
        bc = s.compute_bytes
        a = self.a_bf16 if s.bf16 else self.a_fp32
        sharded = dp > 1
        b16 = 0.0
        if s.bf16 and not sharded:
            b16 = 2.0 * (s.embedding + s.layer_params) if s.checkpointing else 2.0 * n
        act = T * h * ((self.k_ckpt if s.checkpointing else a) * L + self.a0)
        upd = {"single": 8.0 * s.p_max / dp, "foreach": 4.0 * nt / dp, "fused": 0.0}[s.optimizer]
        return {
            "W": 4.0 * n / dp,
            "G": 4.0 * nt / dp,
            "S": 8.0 * nt / dp,
            "B16": b16,
            "A": act,
            "X": self.logit_bytes(s),
            "F": (2.0 * bc + 4.0) * s.layer_params if sharded else 0.0,
            "D": 0.0 if s.lora else (16.0 + (bc if sharded else 0.0)) * s.embedding,
            "U": upd,
            "C": self.overhead,
        }

    def logit_bytes(self, s: TrainShape) -> float:
        """``X``: the lm_head's logits and the logprob / entropy buffers (module docstring)."""
        head = s.logits_kept * s.tokens * s.vocab * s.compute_bytes
        per = CHUNKED_LOGIT_BYTES if s.chunked_logprobs else self.v
        return head + per * s.response_share * s.tokens * s.vocab

    def loss_bytes(self, s: TrainShape) -> float:
        """The backward's start: ``W + G + S + B16 + A + X + F + C``."""
        t = self.terms(s)
        return sum(t[k] for k in ("W", "G", "S", "B16", "A", "X", "F", "C"))

    def embedding_bytes(self, s: TrainShape) -> float:
        """The backward's end: ``W + G + S + D + C``."""
        t = self.terms(s)
        return sum(t[k] for k in ("W", "G", "S", "D", "C"))

    def backward_bytes(self, s: TrainShape) -> float:
        """``max(loss, embedding)``."""
        return max(self.loss_bytes(s), self.embedding_bytes(s))

    def optimizer_bytes(self, s: TrainShape) -> float:
        """``W + G + S + U + C``."""
        t = self.terms(s)
        return sum(t[k] for k in ("W", "G", "S", "U", "C"))

    def peak_bytes(self, s: TrainShape) -> float:
        """``max(backward, optimizer)``."""
        return max(self.backward_bytes(s), self.optimizer_bytes(s))

    def persistent_bytes(self, s: TrainShape) -> float:
        """What a rank holds between updates: ``W + S + C`` (gradients are freed)."""
        t = self.terms(s)
        return t["W"] + t["S"] + t["C"]

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


COEFFICIENTS = tuple(f.name for f in fields(TrainMemoryModel))


def _features(s: TrainShape) -> dict[str, float]:
    """The coefficients' multipliers in the backward phase (the rest of it is counted)."""
    per_layer = s.tokens * s.hidden * s.layers
    a_mult = 0.0 if s.checkpointing else per_layer
    return {
        "a_fp32": 0.0 if s.bf16 else a_mult,
        "a_bf16": a_mult if s.bf16 else 0.0,
        "k_ckpt": per_layer if s.checkpointing else 0.0,
        "a0": s.tokens * s.hidden,
        "v": s.response_share * s.tokens * s.vocab,
        "overhead": 1.0,
    }


_ZERO = TrainMemoryModel(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def fit(points: Iterable[tuple[TrainShape, float, float]]) -> TrainMemoryModel:
    """Least-squares coefficients from measured ``(shape, backward bytes, optimizer bytes)``.

    Each phase's measurement minus its counted terms (the model with all coefficients 0) is
    linear in the coefficients (:func:`_features`; the optimizer phase depends on
    ``overhead`` only); rows are weighted by 1 / measured, so relative errors are minimised.
    A backward peak within 2% of the counted ``embedding`` point (small micro-batches: the peak
    is the embedding's gradient, not the loss's backward) says nothing of the loss point's
    coefficients and is left out. A coefficient no point informs stays 0.
    """
    rows: list[list[float]] = []
    rhs: list[float] = []
    for s, bwd, opt in points:
        if bwd <= 0 or opt <= 0:
            raise ValueError(f"fit: measured bytes must be > 0 (got {bwd}, {opt} for {s})")
        f = _features(s)
        if bwd > 1.02 * _ZERO.embedding_bytes(s):
            rows.append([f[c] / bwd for c in COEFFICIENTS])
            rhs.append((bwd - _ZERO.loss_bytes(s)) / bwd)
        rows.append([(1.0 if c == "overhead" else 0.0) / opt for c in COEFFICIENTS])
        rhs.append((opt - _ZERO.optimizer_bytes(s)) / opt)
    if len(rows) < 3:
        raise ValueError("fit: need at least two measured configurations")
    x = np.asarray(rows)
    used = np.abs(x).sum(axis=0) > 0
    coef = np.zeros(len(COEFFICIENTS))
    sol, *_ = np.linalg.lstsq(x[:, used], np.asarray(rhs), rcond=None)
    coef[used] = sol
    return TrainMemoryModel(**{c: float(v) for c, v in zip(COEFFICIENTS, coef, strict=True)})


BENCH_FLAGS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16": True},
    "fp32_ckpt": {"checkpointing": True},
    "bf16_ckpt": {"bf16": True, "checkpointing": True},
    "lora": {"lora": True},
    "fp32_foreach": {"optimizer": "foreach"},
    "fsdp2_x2": {"dp": 2},
}
"""The :class:`TrainShape` flags of each ``bench/scale.py`` configuration."""


def bench_shape(row: Mapping[str, Any]) -> TrainShape:
    """The shape of one ``bench/scale.py --memory`` row (keys ``config``, ``params``,
    ``trainable``, ``hidden``, ``layers``, ``vocab``, ``tokens``, ``response_share``,
    ``largest_trained``)."""
    name = row["config"]
    if name not in BENCH_FLAGS:
        raise ValueError(f"bench row: unknown configuration {name!r} (known: {list(BENCH_FLAGS)})")
    return TrainShape(
        params=float(row["params"]),
        trainable=float(row["trainable"]),
        hidden=int(row["hidden"]),
        layers=int(row["layers"]),
        vocab=int(row["vocab"]),
        tokens=int(row["tokens"]),
        response_share=float(row["response_share"]),
        largest_trained=float(row["largest_trained"]),
        **BENCH_FLAGS[name],
    )


def compare(model: TrainMemoryModel, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Measured vs predicted MB per phase and peak for bench rows (``backward_mb``,
    ``optimizer_mb``), with the relative error of the peak."""
    out = []
    for r in rows:
        s = bench_shape(r)
        pb, po = model.backward_bytes(s) / MB, model.optimizer_bytes(s) / MB
        meas = max(float(r["backward_mb"]), float(r["optimizer_mb"]))
        pred = max(pb, po)
        out.append(
            {
                **{k: r[k] for k in ("config", "hidden", "layers", "vocab", "tokens")},
                "response_share": round(float(r["response_share"]), 4),
                "backward_mb": round(float(r["backward_mb"]), 2),
                "backward_pred_mb": round(pb, 2),
                "optimizer_mb": round(float(r["optimizer_mb"]), 2),
                "optimizer_pred_mb": round(po, 2),
                "peak_mb": round(meas, 2),
                "peak_pred_mb": round(pred, 2),
                "error": round((pred - meas) / meas, 4),
            }
        )
    return out


CALIBRATED = TrainMemoryModel(
    a_fp32=76.7814,
    a_bf16=49.0353,
    k_ckpt=5.6863,
    a0=10.4283,
    v=22.5459,
    overhead=30234.7366,
)
"""``fit`` on this project's 2-core CPU (torch 2.13 CPU allocator, 1 thread, Llama with tied
embeddings, MLP 8/3 h, heads h/64, rows of 16 prompt + 48 response tokens, SDPA attention),
three sizes (hidden x layers x vocabulary 256x2x4096, 256x6x16384, 512x4x8192) x micro-batches
of 256 and 1024 tokens x fp32, bf16, fp32 + checkpointing, LoRA r=16 on all projections:

    OMP_NUM_THREADS=1 PYTHONPATH=src python bench/scale.py --memory --rows-file rows.jsonl

(defaults: ``--sizes 256x2x4096,256x6x16384,512x4x8192,512x8x32000 --fit-sizes 0,1,2
--tokens 128,256,512,1024 --fit-tokens 256,1024``; bf16 + checkpointing and foreach AdamW are
measured, never fitted). Its errors in the fit and out of sample (the 41.6M-parameter
512x8x32000, the 128- and 512-token micro-batches, bf16 + checkpointing, foreach) are in
docs/scale.md, with the table. Reading: 77 bytes of fp32 activations per token, layer and
hidden unit (49 under bf16 autocast), 5.7 per layer under checkpointing (its fp32 input, 4,
and a little), 10 outside the layers, 22.5 bytes (5.6 fp32 buffers) per response token and
vocabulary entry for the logprob / entropy computation, 30 KB fixed."""
