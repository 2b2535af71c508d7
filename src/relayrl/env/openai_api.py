"""The endpoint's request checks, reply choices and Responses API (``relayrl.env.openai_server``).

- :class:`APIError` and the parameter readers the routes share; the reply's choices of a
  recorded call (:func:`chat_choice`, :func:`completion_choice`).
- :func:`refuse_unsupported`: every request parameter the endpoint does not honour is a 400
  naming it, never silently ignored: ``tool_choice`` ``"required"`` or a named function,
  ``parallel_tool_calls: false``, a ``response_format`` other than text, non-zero
  ``presence_penalty`` / ``frequency_penalty``, a ``logit_bias``, ``echo``, ``best_of`` > 1,
  ``suffix``; of vLLM's extra fields, non-zero ``min_p`` / ``min_tokens``,
  ``include_stop_str_in_output`` and ``use_beam_search`` (``top_k``, ``stop_token_ids`` and
  ``ignore_eos`` are honoured). :func:`top_asked`: ``top_logprobs`` (a 400 where the engine
  keeps no alternatives; always on the Responses API). :func:`check_room`: a ``max_tokens``
  past the context is a 400, as vLLM answers it. :func:`check_sequences`: a request asking
  for more than the server's ``max_sequences_per_request`` sequences (prompts x ``n``) is a
  400 before anything is tokenised or queued.
- Streaming (``stream: true`` on chat and completions): :mod:`relayrl.env.openai_stream`.
- The Responses API (``POST /v1/responses``, the OpenAI Agents SDK's default): ``input`` (a
  string, or items: messages with string or ``input_text`` content, ``function_call`` and
  ``function_call_output``), ``instructions`` (a system message), flat function ``tools``,
  ``max_output_tokens``, sampling as in chat, are turned into a chat request; the reply
  becomes a ``response`` whose ``output`` holds a ``message`` (``output_text``) and/or
  ``function_call`` items. ``previous_response_id`` (server-side state) is refused with 400;
  ``stream: true`` answers the Responses API's events (``openai_stream.response_events``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from relayrl.env.sessions import CallRecord
from relayrl.rollout.types import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = (
            status,
            message,
            code,
            param,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


def number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise APIError(400, f"{name} must be a number, got {value!r}", "invalid_type", name)
    if not lo <= value <= hi:
        raise APIError(400, f"{name} must be in [{lo}, {hi}], got {value}", "invalid_value", name)
    return float(value)


def integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(400, f"{name} must be an integer, got {value!r}", "invalid_type", name)
    return value


def logprobs_on(body: dict[str, Any], chat: bool) -> bool:
    """Whether a request asks for per-token logprobs: chat's ``logprobs`` is a boolean, the
    completions' an integer >= 0 (0 asks for them too, with no alternatives)."""
    value = body.get("logprobs")
    if value is None:
        return False
    if chat and isinstance(value, bool):
        return value
    if not chat and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return True
    want = "a boolean" if chat else "an integer >= 0"
    raise APIError(400, f"logprobs must be {want}, got {value!r}", "invalid_type", "logprobs")


def stop_params(
    body: dict[str, Any], encode: Callable[[str], list[int]]
) -> tuple[list[str], list[int]]:
    """A request's stop strings and engine stop ids: ``stop_token_ids`` and the one token of
    each stop string that ``encode`` makes one token."""
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(
            400, "stop must be a string or a list of non-empty strings", "invalid_type", "stop"
        )
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise APIError(
            400, "stop_token_ids must be a list of integers", "invalid_type", "stop_token_ids"
        )
    ids = list(ids)  # the body's own list is left as it came
    for s in stops:
        enc = encode(s)
        if len(enc) == 1:
            ids.append(enc[0])
    return stops, ids


def sampling_params(
    body: dict[str, Any], session: Any, rendering: Any, default_max_tokens: int
) -> tuple[SamplingParams, list[str]]:
    """A request's sampling params and stop strings. A session's ``sampling`` settings win
    (its ``max_tokens`` is a cap; its seed, when set, gives each call's seed);
    ``default_max_tokens`` when the request names none (the engine caps it at the rest of the
    context). ``rendering`` (a ``ChatRendering``): the template's stop ids, stop strings' ids."""
    forced = session.sampling if session is not None else {}
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise APIError(400, "top_p must be > 0", "invalid_value", "top_p")
    max_tokens = integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens")
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(
            400, f"max_tokens must be > 0, got {max_tokens}", "invalid_value", "max_tokens"
        )
    if max_tokens is None:
        max_tokens = default_max_tokens
    if "max_tokens" in forced:
        max_tokens = min(max_tokens, int(forced["max_tokens"]))
    top_k = integer(body, "top_k") or 0  # vLLM's field (extra_body); 0 or -1: off
    if top_k < -1:
        raise APIError(400, f"top_k must be >= -1, got {top_k}", "invalid_value", "top_k")
    seed = integer(body, "seed")
    if session is not None and session.sampling.get("seed") is not None:
        seed = session.next_seed()
    stops, stop_ids = stop_params(body, rendering.encode)
    params = SamplingParams(
        temperature=float(forced.get("temperature", temperature)),
        top_p=float(forced.get("top_p", top_p)),
        top_k=int(forced.get("top_k", max(top_k, 0))),
        max_tokens=max_tokens,
        stop_token_ids=sorted(set(rendering.stop_ids) | set(stop_ids)),
        seed=seed,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    return params, stops


def top_asked(body: dict[str, Any], chat: bool, supported: bool) -> int:
    """Alternatives per token a request asks for: chat's ``top_logprobs`` (0 to 20, only with
    ``logprobs: true``), the completions' ``logprobs`` k (0 to 20). An engine without them
    (``supported`` false; the built-in engine, the engine process and vLLM keep them): chat's
    is a 400, the completions' ``top_logprobs`` stay null."""
    name = "top_logprobs" if chat else "logprobs"
    if not chat and body.get("top_logprobs"):
        raise _unsupported("top_logprobs", "top_logprobs on completions (logprobs: k asks)")
    k = integer(body, "top_logprobs") if chat else body.get("logprobs")
    k = k or 0  # the completions' logprobs: checked by ``logprobs_on``
    if not 0 <= k <= 20:
        raise APIError(400, f"{name} must be in [0, 20], got {k}", "invalid_value", name)
    if chat and k and not body.get("logprobs"):
        raise APIError(400, "top_logprobs needs logprobs: true", "invalid_value", name)
    if chat and k and not supported:
        raise _unsupported(name, "top_logprobs > 0 on this engine (it keeps no alternatives)")
    return k if supported else 0


def _unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this endpoint", "unsupported", param)


def refuse_unsupported(body: dict[str, Any]) -> None:
    """A 400 naming the first parameter the endpoint would not honour (see module)."""
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _unsupported("tool_choice", f"tool_choice={json.dumps(choice)} (auto and none are)")
    if body.get("parallel_tool_calls") is False:
        raise _unsupported("parallel_tool_calls", "parallel_tool_calls=false")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _unsupported("response_format", "a response_format other than text")
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if body.get(name) not in (None, 0, 0.0, 1.0 if name == "repetition_penalty" else 0):
            raise _unsupported(name, f"{name}={body.get(name)}")
    if body.get("logit_bias"):
        raise _unsupported("logit_bias", "logit_bias")
    if body.get("echo"):
        raise _unsupported("echo", "echo=true")
    if (integer(body, "best_of") or 1) > 1:
        raise _unsupported("best_of", "best_of > 1")
    if body.get("suffix"):
        raise _unsupported("suffix", "suffix")
    # vLLM's extra sampling fields the engine has no counterpart of (``top_k`` it has)
    for name in ("min_p", "min_tokens"):
        if body.get(name) not in (None, 0, 0.0):
            raise _unsupported(name, f"{name}={body.get(name)}")
    for name in ("include_stop_str_in_output", "use_beam_search"):
        if body.get(name):
            raise _unsupported(name, f"{name}=true")


# ---------------------------------------------------------------------- reply choices
def _ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """A completions request's prompts, as vLLM takes them: text, token ids (``list[int]``),
    or a batch of either (``list[str]`` / ``list[list[int]]``; every entry non-empty)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [prompt]
    if isinstance(prompt, list) and _ids(prompt):
        return [[int(t) for t in prompt]]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) and p for p in prompt):
            return list(prompt)
        if all(_ids(p) for p in prompt):
            return [[int(t) for t in p] for p in prompt]
    raise APIError(
        400,
        "prompt must be a non-empty string, a non-empty list of token ids, or a non-empty "
        "list of either (a batch; every prompt non-empty)",
        "invalid_prompt",
        "prompt",
    )


def check_sequences(body: dict[str, Any], chat: bool, limit: int | None) -> None:
    """400 when a request asks for more than ``limit`` sequences: ``prompts * n`` (chat: one
    prompt; completions: a batch's length, counted from the body before anything is tokenised;
    ``n`` defaults to 1). ``limit`` None: unbounded."""
    if limit is None:
        return
    n = integer(body, "n") or 1
    prompt = body.get("prompt")
    prompts = 1
    if not chat and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = len(prompt)  # a batch (a plain list of token ids is one prompt)
    if prompts * n <= limit:
        return
    asked = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
    raise APIError(
        400,
        f"this request asks for {prompts * n} sequences ({asked}); this server generates at "
        f"most {limit} per request (max_sequences_per_request): send fewer prompts or a "
        "smaller n",
        "too_many_sequences",
        "prompt" if prompts > 1 else "n",
    )


def check_room(prompt_len: int, limit: int | None, body: dict[str, Any], kind: str) -> None:
    """400 unless the context (``limit`` tokens) leaves room to generate after the prompt
    (``context_length_exceeded``) and, as vLLM, the request's own ``max_tokens`` /
    ``max_completion_tokens`` fits in the rest: ``max_tokens <= limit - prompt_len``."""
    if limit is None:
        return
    if prompt_len >= limit:
        raise APIError(
            400,
            f"this request has {prompt_len} prompt tokens but the model's context is "
            f"{limit} tokens: no room to generate (shorten the conversation)",
            "context_length_exceeded",
            "messages" if kind == "chat" else "prompt",
        )
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else None
    name = name or ("max_tokens" if body.get("max_tokens") is not None else None)
    asked = integer(body, name) if name else None
    if asked is not None and asked > limit - prompt_len:
        name = str(body.get("_max_tokens_param") or name)  # the Responses API's own name
        raise APIError(
            400,
            f"{name} is too large: {asked} > {limit} - {prompt_len} (the model's context is "
            f"{limit} tokens and the prompt has {prompt_len}): ask for at most "
            f"{limit - prompt_len}",
            "invalid_value",
            name,
        )


def record_call(
    tokenizer: Any, kind: str, prompt: list[int], params: Any, stops: list[str], sample: Any
) -> tuple[CallRecord, str | None]:
    """A finished choice (an engine ``Sample``) as its recorded call, cut after the token that
    completes its first stop string (:func:`cut_at_stop`), and that stop string."""
    k, hit = cut_at_stop(tokenizer, sample.response_ids, stops)
    reason = "stop" if hit else ("length" if sample.finish_reason == "length" else "stop")
    sampling = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "max_tokens": params.max_tokens,
        "stop_token_ids": params.stop_token_ids,
        "seed": params.seed,
    }
    top = sample.top_logprobs
    ids, lps, vs = sample.response_ids, sample.behaviour_logprobs, sample.versions
    call = CallRecord(kind, list(prompt), ids[:k], lps[:k], vs[:k], reason, sampling)
    call.top_logprobs = None if top is None else top[:k]
    return call, hit


def cut_at_stop(tokenizer: Any, ids: list[int], stops: list[str]) -> tuple[int, str | None]:
    """How many completion tokens to keep: up to the token completing the first stop string
    (the tokens after it are dropped, never trained), and that string."""
    if not stops:
        return len(ids), None
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not any(s in text for s in stops):
        return len(ids), None
    for k in range(1, len(ids) + 1):
        part = tokenizer.decode(ids[:k], skip_special_tokens=True)
        for s in stops:
            if s in part:
                return k, s
    return len(ids), None


Alternatives = list[list[tuple[str, float]]]
"""Per token, its alternatives as (token text, logprob), most likely first."""


def chat_logprobs(texts: list[str], lps: list[float], alts: Alternatives | None) -> Any:
    """Chat's ``logprobs``: per token ``token`` / ``logprob`` / ``bytes`` / ``top_logprobs``."""

    def entry(t: str, lp: float) -> dict[str, Any]:
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    tops = alts if alts is not None else [[] for _ in texts]
    return {
        "content": [
            {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
            for t, lp, top in zip(texts, lps, tops, strict=True)
        ]
    }


def completion_top(alts: Alternatives | None) -> list[dict[str, float]] | None:
    """Completions' ``top_logprobs``: per token ``{text: logprob}`` (null when not asked)."""
    return None if alts is None else [dict(top) for top in alts]


def chat_choice(
    rendering: Any,
    index: int,
    call: Any,
    hit: str | None,
    parse: bool,
    token_texts: list[str] | None,
    alts: Alternatives | None = None,
) -> dict[str, Any]:
    """A chat reply's choice of a recorded call (a ``CallRecord``): the message
    (``rendering.message``, cut before the stop string ``hit``), per-token ``logprobs`` when
    ``token_texts`` are given (``alts``: each token's ``top_logprobs``), relayrl's
    ``token_ids`` and ``versions``."""
    message = rendering.message(call.completion_ids, parse_tools=parse)
    if hit and isinstance(message.get("content"), str):
        message["content"] = message["content"].split(hit)[0]
    finish = "tool_calls" if message.get("tool_calls") else call.finish_reason
    logprobs = None
    if token_texts is not None:
        logprobs = chat_logprobs(token_texts, call.logprobs, alts)
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish,
        "token_ids": call.completion_ids,
        "versions": call.versions,
    }


def completion_choice(
    tokenizer: Any,
    index: int,
    call: Any,
    hit: str | None,
    token_texts: list[str] | None,
    alts: Alternatives | None = None,
) -> dict[str, Any]:
    """A completions reply's choice of a recorded call: the text (special tokens skipped, cut
    before ``hit``), ``logprobs`` (``tokens`` / ``token_logprobs`` / ``text_offset``) when
    ``token_texts`` are given, relayrl's ``token_ids`` and ``versions``."""
    text = tokenizer.decode(call.completion_ids, skip_special_tokens=True)
    if hit:
        text = text.split(hit)[0]
    logprobs = None
    if token_texts is not None:
        offsets, pos = [], 0
        for t in token_texts:
            offsets.append(pos)
            pos += len(t)
        logprobs = {
            "tokens": token_texts,
            "token_logprobs": call.logprobs,
            "top_logprobs": completion_top(alts),
            "text_offset": offsets,
        }
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": call.finish_reason,
        "token_ids": call.completion_ids,
        "versions": call.versions,
    }


# ---------------------------------------------------------------------- Responses API
def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
        )
    raise APIError(
        400, "a message's content must be a string or text parts", "invalid_type", "input"
    )


def responses_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/responses`` request as a chat request (see module)."""
    for name in ("previous_response_id", "conversation"):
        if body.get(name):
            raise _unsupported(name, f"{name} (server-side conversation state)")
    if body.get("top_logprobs"):
        raise _unsupported("top_logprobs", "top_logprobs on the Responses API")
    messages: list[dict[str, Any]] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": str(body["instructions"])})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(
            400, "input must be a string or a non-empty list of items", "invalid_type", "input"
        )
    for it in items:
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message":
            messages.append({"role": it.get("role", "user"), "content": _text_of(it["content"])})
        elif kind == "function_call":
            call = {
                "id": it.get("call_id") or it.get("id"),
                "type": "function",
                "function": {"name": it["name"], "arguments": it.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": it.get("call_id"),
                    "content": out if isinstance(out, str) else json.dumps(out),
                }
            )
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: none is produced here
        else:
            raise _unsupported("input", f"an input item of type {kind!r}")
    tools = []
    for t in body.get("tools") or []:
        if not isinstance(t, dict) or t.get("type") != "function":
            raise _unsupported(
                "tools", f"a tool of type {t.get('type') if isinstance(t, dict) else t!r}"
            )
        fn = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        tools.append({"type": "function", "function": fn})
    chat: dict[str, Any] = {"messages": messages, "model": body.get("model")}
    if tools:
        chat["tools"] = tools
    for k in ("temperature", "top_p", "seed", "tool_choice", "parallel_tool_calls"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
        chat["_max_tokens_param"] = "max_output_tokens"  # named in a too-large error
    text = body.get("text") or {}
    if isinstance(text, dict) and text.get("format") not in (None, {"type": "text"}):
        raise _unsupported("text.format", "a text.format other than text")
    return chat


def chat_to_response(reply: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A chat reply as a ``response`` object (see module)."""
    ch = reply["choices"][0]
    msg = ch["message"]
    output: list[dict[str, Any]] = []
    if msg.get("content"):
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex[:24]}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": msg["content"], "annotations": []}],
            }
        )
    for call in msg.get("tool_calls") or []:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex[:24]}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    u = reply["usage"]
    incomplete = ch["finish_reason"] == "length"
    return {
        "id": "resp_" + reply["id"].removeprefix("chatcmpl-"),  # the recorded call's key
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": reply["model"],
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "instructions": body.get("instructions"),
        "metadata": {},
        "usage": {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        },
        "token_ids": ch["token_ids"],
        "versions": ch["versions"],
        "prompt_token_ids": reply["prompt_token_ids"],
    }
