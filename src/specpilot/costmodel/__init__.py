"""Phase 0 cost model: the gap to ideal as tau x kernel x overhead factors (``specpilot profile``).

Public API::

    from specpilot.costmodel import ProfileConfig, profile
    report = profile(engine, prompts, make_drafter, spec, ProfileConfig(max_new_tokens=64))
    report.direction, report.factors, report.to_json()

Modules: :mod:`.replay` (exact replay, tau_bf / tau_opt), :mod:`.roofline` (FLOPs, bytes,
floors), :mod:`.hardware` (peak table, calibration), :mod:`.measure` (profiler ranges, verify
timing), :mod:`.report` (factors, direction, sensitivity), :mod:`.html` (the HTML page),
:mod:`.pipeline` (``profile``).
"""

from specpilot.costmodel.hardware import Hardware, detect
from specpilot.costmodel.pipeline import ProfileConfig, profile
from specpilot.costmodel.report import BudgetPoint, CostReport, KernelRow, SensitivityPoint

__all__ = [
    "BudgetPoint",
    "CostReport",
    "Hardware",
    "KernelRow",
    "ProfileConfig",
    "SensitivityPoint",
    "detect",
    "profile",
]
