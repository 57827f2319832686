"""Configuration of the LLM agents (``specpilot optimize --agent openai ...``): validated here."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from specpilot.errors import ConfigError

KINDS = ("openai",)
SANDBOX_LEVELS = ("auto", "strong", "audit")


@dataclass(frozen=True)
class AgentConfig:
    """One OpenAI-compatible endpoint; one agent per worker explores one direction each round."""

    kind: str = "openai"
    """Protocol of the endpoint: "openai" (chat completions, any compatible server)."""
    base_url: str = ""
    """Endpoint root, e.g. ``https://api.openai.com/v1`` or ``http://127.0.0.1:8000/v1``."""
    model: str = ""
    """Model name sent to the endpoint."""
    api_key_env: str = "OPENAI_API_KEY"
    """Environment variable holding the key (read once at start; never logged or written)."""
    timeout_s: float = 120.0
    """One request's timeout."""
    retries: int = 3
    """Retries of one request after a connection error, timeout, 429 or 5xx."""
    backoff_s: float = 2.0
    """First retry delay; doubled each retry (a 429's Retry-After is honoured up to
    ``max_backoff_s``)."""
    max_backoff_s: float = 30.0
    requests_per_round: int = 3
    """Requests one agent may make per round (a rejected reply is fed back and asked again)."""
    agents: int = 0
    """Agents per round, each on its own direction (0 = one per worker)."""
    candidates: int = 1
    """Candidates one agent contributes per round (the built-in explorer fills the rest)."""
    max_tokens: int = 2048
    max_prompt_chars: int = 0
    """Cut each message to this many characters (0 = no cut): for small local models whose
    context cannot hold the whole brief."""
    temperature: float = 0.2
    sandbox: str = "auto"
    """"auto" (the strongest this machine has), "strong" (Landlock + network namespace, else
    refuse to start) or "audit" (the weak fallback only; for comparison and tests)."""
    unsafe_skip_static_check: bool = False
    """Tests only: check syntax and the protocol but not names/imports, so that the runtime
    sandbox alone stands between malicious source and the machine."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"--agent must be one of {KINDS}, got {self.kind!r}")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"--agent-base-url must be an http(s) URL such as http://127.0.0.1:8000/v1, "
                f"got {self.base_url!r}"
            )
        if parts.username or parts.password:
            raise ConfigError(
                "--agent-base-url must not carry credentials (they would be journaled); put the "
                "key in the variable named by --agent-api-key-env"
            )
        if not self.model:
            raise ConfigError("--agent-model is required with --agent (the endpoint's model name)")
        if not self.api_key_env.replace("_", "").isalnum():
            raise ConfigError(f"--agent-api-key-env: not a variable name: {self.api_key_env!r}")
        if self.sandbox not in SANDBOX_LEVELS:
            raise ConfigError(f"agent sandbox: one of {SANDBOX_LEVELS}, not {self.sandbox!r}")
        for name in ("timeout_s", "backoff_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"agent {name} must be positive, got {getattr(self, name)}")
        for name in ("retries", "agents", "max_prompt_chars"):
            if getattr(self, name) < 0:
                raise ConfigError(f"agent {name} must be >= 0, got {getattr(self, name)}")
        for name in ("requests_per_round", "candidates", "max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"agent {name} must be >= 1, got {getattr(self, name)}")

    @property
    def endpoint(self) -> str:
        """The base URL without query or fragment (what provenance records)."""
        p = urlsplit(self.base_url)
        return urlunsplit((p.scheme, p.netloc, p.path, "", ""))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> AgentConfig:
        from specpilot.mechanisms.base import parse_dataclass

        return parse_dataclass(cls, d, "agent")
