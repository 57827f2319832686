"""The chat client of the agents: any OpenAI-compatible endpoint through the ``openai`` package.

:meth:`ChatClient.complete` returns the reply's text or raises :class:`AgentError` with a kind
and a reason that never contains the API key. Connection errors, timeouts, rate limits (429) and
server errors (5xx) are retried up to ``retries`` times with exponential backoff (a 429's
``Retry-After`` is honoured, capped); other HTTP errors (401, 404 ...) and empty or malformed
replies are not retried here (the agent asks again with the reason, see :mod:`.explorer`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from specpilot.agent.config import AgentConfig
from specpilot.errors import ConfigError

UNREACHABLE, TIMEOUT, RATE_LIMITED, HTTP_ERROR, EMPTY, MALFORMED = (
    "unreachable", "timeout", "rate_limited", "http_error", "empty", "malformed",
)  # fmt: skip
RETRIED = (UNREACHABLE, TIMEOUT, RATE_LIMITED)


class AgentError(Exception):
    """A request that produced no usable reply."""

    def __init__(
        self, kind: str, reason: str, attempts: int = 1, retry_after: float | None = None
    ) -> None:
        super().__init__(reason)
        self.kind, self.reason, self.attempts = kind, reason, attempts
        self.retry_after = retry_after
        """Seconds the server asked to wait (a 429's Retry-After), if any."""


class ChatClient:
    """One endpoint; thread-safe (the ``openai`` client is)."""

    def __init__(
        self,
        cfg: AgentConfig,
        api_key: str | None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        try:
            import openai
        except ImportError:
            raise ConfigError(
                "--agent openai needs the openai package: pip install 'specpilot[agent]'"
            ) from None
        self.cfg = cfg
        self.openai = openai
        self._key = api_key or ""
        self.sleep = sleep
        self.client = openai.OpenAI(
            base_url=cfg.base_url,
            api_key=api_key or "EMPTY",  # local servers ignore it; the client needs one
            timeout=cfg.timeout_s,
            max_retries=0,
        )

    def scrub(self, text: str) -> str:
        """``text`` with the API key masked (error bodies may echo it)."""
        return text.replace(self._key, "***") if len(self._key) >= 4 else text

    def complete(self, messages: Sequence[dict[str, str]]) -> tuple[str, int]:
        """(reply text, attempts used); AgentError when there is none."""
        cfg = self.cfg
        for attempt in range(cfg.retries + 1):
            try:
                return self._once(messages), attempt + 1
            except AgentError as e:
                e.attempts = attempt + 1
                e.reason = self.scrub(e.reason)
                e.args = (e.reason,)
                if e.kind not in RETRIED or attempt == cfg.retries:
                    raise
                self.sleep(self._delay(attempt, e.retry_after))
        raise AssertionError("unreachable")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        delay = self.cfg.backoff_s * (2**attempt)
        if retry_after is not None:
            delay = max(delay, retry_after)
        return min(delay, self.cfg.max_backoff_s)

    def _once(self, messages: Sequence[dict[str, str]]) -> str:
        oa = self.openai
        try:
            resp = self.client.chat.completions.create(
                model=self.cfg.model,
                messages=list(messages),  # type: ignore[arg-type]
                max_tokens=self.cfg.max_tokens,
                temperature=self.cfg.temperature,
            )
        except oa.APITimeoutError:
            raise AgentError(TIMEOUT, f"no reply within {self.cfg.timeout_s:.0f} s") from None
        except oa.APIConnectionError as e:
            raise AgentError(UNREACHABLE, f"endpoint unreachable: {_cause(e)}") from None
        except oa.RateLimitError as e:
            why = f"rate limited (HTTP 429): {_body(e)}"
            raise AgentError(RATE_LIMITED, why, retry_after=_retry_after(e)) from None
        except oa.APIStatusError as e:
            kind = UNREACHABLE if e.status_code >= 500 else HTTP_ERROR
            raise AgentError(kind, f"HTTP {e.status_code}: {_body(e)}") from None
        except (oa.APIError, ValueError) as e:  # e.g. a 200 whose body is not a completion
            raise AgentError(MALFORMED, f"malformed reply: {type(e).__name__}: {e}") from None
        try:
            choice = resp.choices[0]
            text = choice.message.content
        except (AttributeError, IndexError, TypeError, KeyError):
            raise AgentError(MALFORMED, f"malformed reply: no choices[0].message in "
                             f"{str(resp)[:200]!r}") from None  # fmt: skip
        if not isinstance(text, str) or not text.strip():
            raise AgentError(EMPTY, "empty reply (no message content)")
        return text


def _cause(e: BaseException) -> str:
    inner = e.__cause__ or e.__context__
    return f"{type(inner).__name__}: {inner}"[:300] if inner else str(e)[:300]


def _body(e: Any) -> str:
    return str(getattr(e, "message", "") or e)[:300]


def _retry_after(e: Any) -> float | None:
    try:
        value = e.response.headers.get("retry-after")
        return float(value) if value is not None else None
    except (AttributeError, TypeError, ValueError):
        return None
