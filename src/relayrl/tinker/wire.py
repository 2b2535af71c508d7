"""The Tinker SDK's protobuf bodies: ``forward_backward`` requests in, ``ForwardBackwardOutput``
and ``SampleResponse`` out (the SDK decodes those two only from protobuf).

The message schema is the SDK's own (``tinker.proto.tinker_public_pb2``, the wire contract);
the conversions here are relayrl's. Tensors travel as raw little-endian bytes: dense
``Tensor`` (float32 / int64, optional shape) or sparse CSR; token chunks as int32 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

from relayrl.tinker.topk import TopRow, dense

PROTO_CONTENT_TYPE = "application/x-protobuf"

_NUMPY_OF = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


class WireError(ValueError):
    """A body that does not decode (a user error)."""


@dataclass
class WireDatum:
    """One datum: the input token ids and its ``loss_fn_inputs`` as 1-D torch tensors."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class WireForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[WireDatum]


def _tensor(msg: pb.Tensor, name: str) -> torch.Tensor:
    dtype = _NUMPY_OF.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2:
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor needs a 2-D shape")
        dense = np.zeros(shape, dtype=dtype)
        for row in range(shape[0]):
            lo, hi = int(crow[row]), int(crow[row + 1])
            dense[row, col[lo:hi]] = values[lo:hi]
        arr = dense
    else:
        arr = np.frombuffer(msg.dense, dtype=dtype).copy()
        if shape:
            if int(np.prod(shape)) != arr.size:
                raise WireError(
                    f"loss_fn_inputs[{name!r}]: shape {shape} does not match {arr.size} values"
                )
            arr = arr.reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(arr))


def decode_forward_backward(body: bytes) -> WireForwardBackward:
    """Parse a ``/api/v1/forward_backward`` body (already zstd-decompressed)."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest ({e})") from e
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i}: {kind} chunks are not supported (text tokens only)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()}
        data.append(WireDatum(tokens, inputs))
    return WireForwardBackward(
        msg.model_id, msg.seq_id, msg.loss_fn, config, msg.forward_only, data
    )


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput`` of per-datum float32 arrays ([N] or [N, K]): one
    ``ArrayRecord`` per run of consecutive datums whose arrays share their trailing shape
    (the SDK reshapes each record's flat arrays by its ``trailing_shape``)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    names = sorted(outputs[0]) if outputs else []
    arrays = [{k: np.asarray(o[k], dtype=np.float32) for k in names} for o in outputs]
    runs: list[list[dict[str, np.ndarray]]] = []
    for row in arrays:
        trailing = [row[k].shape[1:] for k in names]
        if not runs or [runs[-1][0][k].shape[1:] for k in names] != trailing:
            runs.append([])
        runs[-1].append(row)
    for run in runs:
        record = msg.loss_fn_outputs.add()
        record.type_tag = "ArrayRecord"
        record.num_datums = len(run)
        for name in names:
            flat = [r[name].reshape(-1) for r in run]
            offsets = np.zeros(len(flat) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([a.nbytes for a in flat])
            bt = record.fields[name]
            bt.data = b"".join(a.tobytes() for a in flat)
            bt.offsets = offsets.tobytes()
            bt.dtype = pb.DTYPE_FLOAT32
            bt.trailing_shape.extend(run[0][name].shape[1:])
    if not outputs:
        msg.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=0)
    return msg.SerializeToString()


@dataclass
class WireSequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """True: ended by EOS or a stop sequence ("stop"); False: by max_tokens ("length")."""
    topk: list[TopRow | None] | None = None
    """Each token's alternatives (``topk_sample_logprobs``), when asked."""


def _topk(msg: pb.TopkLogprobs, rows: list[TopRow | None], k: int) -> None:
    ids, lps = dense(rows, k)
    msg.token_ids, msg.logprobs = ids.tobytes(), lps.tobytes()
    msg.k, msg.length = k, len(rows)


def encode_sample_response(
    sequences: list[WireSequence],
    prompt_logprobs: list[float | None] | None,
    topk_prompt: list[TopRow | None] | None = None,
    k: tuple[int, int] = (0, 0),
) -> bytes:
    """A ``SampleResponse``; prompt logprobs are float32 with NaN for the first position.
    ``k``: (topk_prompt_logprobs, topk_sample_logprobs), the width of ``topk_prompt`` and of
    each sequence's ``topk`` (:mod:`relayrl.tinker.topk`; a 0 leaves the field out)."""
    msg = pb.SampleResponse()
    for seq in sequences:
        s = msg.sequences.add()
        s.stop_reason = pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if k[1] > 0:
            _topk(s.topk_sampled_logprobs, seq.topk or [], k[1])
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    if k[0] > 0 and topk_prompt is not None:
        _topk(msg.topk_prompt_logprobs, topk_prompt, k[0])
    return msg.SerializeToString()
