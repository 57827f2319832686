"""The OpenAI request bodies the server accepts: pydantic models, and their OpenAI error bodies.

:class:`CompletionRequest` and :class:`ChatRequest` are the FastAPI body models of
``/v1/completions`` and ``/v1/chat/completions``; ``to_gen(context_len)`` turns a validated body
into the frozen :class:`GenRequest` the handlers use. Only what the engine can honour is
accepted: one choice (``n == 1``), no log-probabilities, no penalties; unknown fields are
ignored, as OpenAI-compatible servers do.

Every rejection is an :class:`APIError` that renders as the OpenAI error body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status; :func:`validation_error`
turns pydantic's (or FastAPI's) validation errors into one, naming the offending field in
``param``. :func:`parse_body` is what the routes' FastAPI dependency calls on the raw body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

from specpilot.sampling import MAX_TEMPERATURE

MAX_STOP = 4
"""Most stop strings per request (as the OpenAI API)."""
MAX_TOP_K = 1 << 30
SEED_RANGE = (-(1 << 63), (1 << 63) - 1)
BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, MAX_TEMPERATURE),
    "top_p": (0.0, 1.0),
    "top_k": (-1, MAX_TOP_K),
    "seed": SEED_RANGE,
}
"""Inclusive ranges of the numeric fields (``max_tokens``: 1 to the context, see ``to_gen``)."""
ALIASES = {"max_completion_tokens": "max_tokens"}
"""Fields reported under another field's name in ``param``."""
M = TypeVar("M", bound=BaseModel)


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


Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, strict=True, allow_inf_nan=False)]
TopP = Annotated[float, Field(ge=0.0, le=1.0, strict=True, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K, strict=True)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1], strict=True)]
MaxTokens = Annotated[int, Field(strict=True)]
"""Range-checked against the context (1 to context_len) by ``to_gen``."""


class _Request(BaseModel):
    """The fields both endpoints take; validated in this order (the first error is reported),
    then the endpoint's own fields (prompt or messages, max_tokens)."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(min_length=1, strict=True)]
    n: Any = 1
    best_of: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    temperature: Temperature | None = None
    seed: Seed | None = None
    stop: Any = Field(default=None, validate_default=True)
    echo: Any = False

    @field_validator("n", "best_of")
    @classmethod
    def _one_choice(cls, v: Any, info: Any) -> Any:
        if v not in (1, None):
            raise ValueError(f"only {info.field_name}=1 is supported")
        return v

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any, info: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError(f"'{info.field_name}' is not supported by this server")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: Any, info: Any) -> Any:
        if v not in (None, 0, 0.0):
            raise ValueError(f"'{info.field_name}' is not supported (sampling stays lossless)")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> tuple[str, ...]:
        if v is None:
            return ()
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("'stop' must be a non-empty string or a list of them")
        if len(stops) > MAX_STOP:
            raise ValueError(f"'stop' takes at most {MAX_STOP} strings")
        return tuple(stops)

    def _gen(
        self, model: str, prompt: str | list[int], messages: Any, max_tokens: int | None
    ) -> GenRequest:
        top_k = max(self.top_k or 0, 0)  # -1 = off (vLLM's spelling)
        top_p = 1.0 if self.top_p is None else self.top_p
        if top_p == 0:  # the smallest set reaching probability 0 is the likeliest token
            top_p, top_k = 1.0, 1
        return GenRequest(
            model=model,
            prompt=prompt,
            messages=messages,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=top_p,
            top_k=top_k,
            seed=self.seed,
            stop=self.stop,
            stream=self.stream,
            include_usage=bool((self.stream_options or {}).get("include_usage", False)),
            echo=bool(self.echo) and messages is None,
        )


def _fits(max_tokens: int | None, context_len: int) -> int | None:
    if max_tokens is not None and not 1 <= max_tokens <= context_len:
        raise APIError(
            400,
            f"'max_tokens' must be between 1 and {context_len}, got {max_tokens}",
            "max_tokens",
        )
    return max_tokens


class CompletionRequest(_Request):
    """Body of ``/v1/completions``: one prompt (a string, or token ids; a batch of one)."""

    prompt: Any
    max_tokens: MaxTokens | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one prompt
        if isinstance(v, str):
            if not v:
                raise ValueError("'prompt' must not be empty")
            return v
        if isinstance(v, list) and v and all(_is_int(t) for t in v):
            return list(v)
        raise ValueError("'prompt' must be one string or one list of token ids")

    def to_gen(self, context_len: int) -> GenRequest:
        """The request, with ``max_tokens`` (default 16) checked against the context."""
        max_tokens = _fits(16 if self.max_tokens is None else self.max_tokens, context_len)
        return self._gen(self.model, self.prompt, None, max_tokens)


class ChatRequest(_Request):
    """Body of ``/v1/chat/completions``: messages with text content."""

    messages: Any = Field(default=None, validate_default=True)
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: Any) -> tuple[dict[str, str], ...]:
        if not isinstance(v, list) or not v:
            raise ValueError("'messages' must be a non-empty list")
        return tuple(_message(i, m) for i, m in enumerate(v))

    def to_gen(self, context_len: int) -> GenRequest:
        """The request; ``max_completion_tokens`` (else ``max_tokens``, else as many as fit)
        checked against the context."""
        given = "max_completion_tokens" in self.model_fields_set
        mt = self.max_completion_tokens if given else self.max_tokens
        return self._gen(self.model, "", self.messages, _fits(mt, context_len))


def _is_int(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _message(i: int, m: Any) -> dict[str, str]:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a 'role'")
    content = m.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in parts) or len(parts) != len(content):
            raise ValueError(f"messages[{i}]: only text content is supported")
        content = "".join(parts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string")
    return {"role": m["role"], "content": content}


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """The OpenAI error body of the first of pydantic's (or FastAPI's) validation errors."""
    if not errors:
        return APIError(400, "invalid request")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ())]
    if loc[:1] == ["body"]:  # FastAPI prefixes body fields
        loc = loc[1:]
    kind = str(err.get("type", ""))
    if kind == "json_invalid" or (not loc and kind == "missing"):
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    if not loc:
        return APIError(400, "the request body must be a JSON object")
    param = ALIASES.get(loc[0], loc[0])
    return APIError(400, _message_of(kind, param, err), param)


def _message_of(kind: str, param: str, err: Mapping[str, Any]) -> str:
    value = err.get("input")
    if kind == "value_error":
        return str(err.get("ctx", {}).get("error", err.get("msg", "")))
    if kind == "missing" or param == "model":
        return f"'{param}' is required"
    if kind in ("float_type", "float_parsing", "finite_number"):
        return f"'{param}' must be a number, got {value!r}"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"'{param}' must be an integer, got {value!r}"
    if kind in ("greater_than_equal", "less_than_equal") and param in BOUNDS:
        lo, hi = BOUNDS[param]
        return f"'{param}' must be between {lo} and {hi}, got {value}"
    if kind == "bool_type":
        return f"'{param}' must be a boolean"
    if kind == "dict_type":
        return f"'{param}' must be an object"
    return f"'{param}': {err.get('msg', 'invalid')}"


def parse_body(model: type[M], raw: bytes) -> M:
    """``raw`` (a request body) decoded as JSON and validated as ``model``; raises
    :class:`APIError` (400, the OpenAI body naming the field)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def parse_request(body: Any, chat: bool, context_len: int) -> GenRequest:
    """Validate a /v1/completions (``chat`` False) or /v1/chat/completions body (a decoded
    JSON value) outside FastAPI; raises :class:`APIError`."""
    model = ChatRequest if chat else CompletionRequest
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None
    return req.to_gen(context_len)
