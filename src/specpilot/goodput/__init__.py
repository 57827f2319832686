"""Goodput-driven verify budget: how many draft nodes to verify this step, for one sequence or a
batch, by expected committed tokens per second.

Three parts, each a small pure piece (the engines own the state):

* :class:`CostCurve` - verify step seconds as a function of the rows in the target forward,
  measured (:func:`calibrate_curve`; the verify forwards, once per machine, model and plan and
  kept on disk: :mod:`specpilot.goodput.curve`) and refreshed online from observed steps;
* :class:`AcceptanceStats` - a drafter's path probability (``exp(score)``) calibrated against
  observed acceptance, per drafter, regime (the sequence's recent run of fully accepted steps)
  and depth (a probability bin per depth, with a prior that trusts the drafter until evidence
  arrives; :mod:`specpilot.goodput.acceptance`); the evidence includes the drafted nodes a step
  did not verify, scored against the tokens committed after them (:mod:`specpilot.goodput.shadow`);
* :func:`choose` - per step, over all live sequences, the draft nodes that maximize
  ``(B + expected accepted) / (t_verify(rows) + t_draft)``, zero nodes (plain decoding, no
  drafting) included, with hysteresis (:class:`Selector`) so the choice does not flap.

Rows. A packed batched verify (``specpilot.verify``, ``packed=True``) costs the rows its trees
have, ``B + nodes``, plus a share of a one-row step per sequence with nodes (accepting and
committing its tree: :attr:`Selector.seq_share`): :func:`choose_packed` spends nodes where
they pay most over the whole batch. Padded, every sequence costs the widest tree's rows,
``B * (w + 1)``: :func:`choose` picks ``w`` and keeps each sequence's ``w`` best nodes. One
sequence is the same rule with ``B = 1``: a drafter that rarely matches decays to plain
decoding.

Lossless: the selector only drops draft nodes (a subtree of the drafter's tree); verification
and acceptance are unchanged, so the output is plain decoding's token for token.
"""

from specpilot.goodput.acceptance import BINS, REGIMES, AcceptanceStats, next_regime, node_gains
from specpilot.goodput.choice import Choice, allocate_nodes, best_nodes, choose, choose_packed
from specpilot.goodput.cost import (
    CALIBRATION_ROWS,
    CostCurve,
    calibrate_curve,
    calibration_shape,
)
from specpilot.goodput.selector import Selector

__all__ = [
    "BINS",
    "CALIBRATION_ROWS",
    "REGIMES",
    "AcceptanceStats",
    "Choice",
    "CostCurve",
    "Selector",
    "allocate_nodes",
    "best_nodes",
    "calibrate_curve",
    "calibration_shape",
    "choose",
    "choose_packed",
    "next_regime",
    "node_gains",
]
