"""Mechanisms: candidate optimizations for the pilot loop, one file each behind the
:class:`~specpilot.mechanisms.base.Mechanism` protocol."""
