"""Mechanisms for the interrupt test: one whose trials stay in flight for a while."""

from __future__ import annotations

from .pilot_planted import SLOW_MECHANISMS

MECHANISMS = SLOW_MECHANISMS
