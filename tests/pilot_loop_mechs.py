"""Mechanisms for the loop tests (both target the kernel factor, the tiny model's largest)."""

from __future__ import annotations

from .pilot_planted import LOOP_MECHANISMS

MECHANISMS = LOOP_MECHANISMS
