"""Drafter training: prompt sources (:mod:`.data`), target features (:mod:`.features`) and
the distillation loop with checkpoints and held-out evaluation (:mod:`.distill`)."""
