"""The OpenAI request bodies the server accepts, validated into frozen dataclasses.

Only what the engine can honour is accepted: one choice (``n == 1``), no log-probabilities, no
penalties. Every rejection is an :class:`APIError` that renders as the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specpilot.sampling import MAX_TEMPERATURE

MAX_STOP = 4
"""Most stop strings per request (as the OpenAI API)."""


class APIError(Exception):
    """An error returned to the client as an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class GenRequest:
    """A validated completion or chat request."""

    model: str
    prompt: str | list[int]
    """Text to tokenize, or token ids (completions only)."""
    messages: tuple[dict[str, str], ...] | None
    """Chat messages (role, content), rendered with the model's chat template."""
    max_tokens: int | None
    """None: as many as fit in the context."""
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool

    @property
    def chat(self) -> bool:
        return self.messages is not None


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(400, f"'{key}' must be a number, got {v!r}", key)
    if not lo <= v <= hi:
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return float(v)


def _int(body: dict[str, Any], key: str, default: int | None, lo: int, hi: int) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise APIError(400, f"'{key}' must be an integer, got {v!r}", key)
    if not lo <= v <= hi:
        raise APIError(400, f"'{key}' must be between {lo} and {hi}, got {v}", key)
    return v


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, "'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise APIError(400, f"'stop' takes at most {MAX_STOP} strings", "stop")
    return tuple(stops)


def _unsupported(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise APIError(400, "only n=1 is supported", "n")
    best_of = body.get("best_of")
    if best_of not in (None, 1):
        raise APIError(400, "only best_of=1 is supported", "best_of")
    for key in ("logprobs", "top_logprobs"):
        if body.get(key) not in (None, False, 0):
            raise APIError(400, f"'{key}' is not supported by this server", key)
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(400, f"'{key}' is not supported (sampling stays lossless)", key)


def _messages(v: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(v, list) or not v:
        raise APIError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if not all(isinstance(t, str) for t in parts) or len(parts) != len(content):
                raise APIError(400, f"messages[{i}]: only text content is supported", "messages")
            content = "".join(parts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def _prompt(v: Any) -> str | list[int]:
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt
    if isinstance(v, str):
        if not v:
            raise APIError(400, "'prompt' must not be empty", "prompt")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    raise APIError(400, "'prompt' must be one string or one list of token ids", "prompt")


def parse_request(body: Any, chat: bool, context_len: int) -> GenRequest:
    """Validate a /v1/completions (``chat`` False) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required", "model")
    _unsupported(body)
    if chat:
        messages: tuple[dict[str, str], ...] | None = _messages(body.get("messages"))
        prompt: str | list[int] = ""
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _int({"max_tokens": mt}, "max_tokens", None, 1, context_len)
    else:
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", "prompt")
        messages, prompt = None, _prompt(body["prompt"])
        max_tokens = _int(body, "max_tokens", 16, 1, context_len)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise APIError(400, "'stream_options' must be an object", "stream_options")
    top_k = max(_int(body, "top_k", 0, -1, 1 << 30) or 0, 0)  # -1 = off (vLLM's spelling)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:  # the smallest set reaching probability 0 is the likeliest token
        top_p, top_k = 1.0, 1
    return GenRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
        top_p=top_p,
        top_k=top_k,
        seed=_int(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        stop=_stop(body),
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        echo=bool(body.get("echo", False)) and not chat,
    )
