"""Registers :mod:`tests.kernel_planted`'s mechanisms (imported by trial children only, through
``ChildSpec.modules``, so the test process's registry stays as the package defines it)."""

from __future__ import annotations

from specpilot.mechanisms import register

from .kernel_planted import MECHANISMS

for _m in MECHANISMS:
    register(_m)
