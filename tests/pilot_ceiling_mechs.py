"""Mechanisms for the ceiling tests: one the scripted executor reports as impossibly fast."""

from __future__ import annotations

from .pilot_planted import CEILING_MECHANISMS

MECHANISMS = CEILING_MECHANISMS
