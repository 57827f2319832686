"""Phase 0 cost model: the gap to ideal as tau x kernel x overhead factors (``specpilot profile``).

Public API::

    from specpilot.costmodel import ProfileConfig, profile
    report = profile(engine, prompts, make_drafter, spec, ProfileConfig(max_new_tokens=64))
    report.direction, report.factors, report.to_json()

A plan whose output differs from plain decoding stops the profile with
:class:`LossyPlanError` (its ``forcing`` attribute is the token-forcing report).

Modules: :mod:`.factors` (the three factors and the direction, pure functions),
:mod:`.replay` (exact replay, tau_bf / tau_opt), :mod:`.roofline` (FLOPs, bytes, floors),
:mod:`.hardware` (peak table, calibration), :mod:`.measure` (profiler ranges, verify timing),
:mod:`.runs` (the token-forced reference / plain / profiled runs), :mod:`.report` (the report,
sensitivity), :mod:`.html` (the HTML page, from ``templates/``), :mod:`.pipeline` (``profile``).
"""

from specpilot.costmodel.hardware import Hardware, detect
from specpilot.costmodel.pipeline import ProfileConfig, profile
from specpilot.costmodel.report import BudgetPoint, CostReport, KernelRow, SensitivityPoint
from specpilot.costmodel.runs import LossyPlanError

__all__ = [
    "BudgetPoint",
    "CostReport",
    "Hardware",
    "KernelRow",
    "LossyPlanError",
    "ProfileConfig",
    "SensitivityPoint",
    "detect",
    "profile",
]
