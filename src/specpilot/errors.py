"""User-facing errors: the CLI shows each as one line and exits non-zero (--debug: traceback)."""

from __future__ import annotations


class SpecPilotError(Exception):
    """Base class: a problem the user can fix; the message says how."""


class ConfigError(SpecPilotError, ValueError):
    """Invalid model, plan or command-line configuration."""


class ModelLoadError(SpecPilotError):
    """A model path is missing, corrupt, or of an unsupported architecture."""


class WorkloadError(SpecPilotError, ValueError):
    """A workload or prompts file is missing or malformed."""


class DrafterError(SpecPilotError, ValueError):
    """A drafter is incompatible with the target (tokenizer, vocabulary) or misconfigured."""


class ContextLengthError(SpecPilotError, ValueError):
    """A prompt (plus requested new tokens) does not fit in the model's context."""
