"""The pilot loop (``specpilot optimize``): a trusted harness that token-forces and times candidate
plans in subprocesses, executors that run trials in parallel, the mechanism memory, and the
coordinator that ties Phase 0 (cost model), Phase 1 (exploration) and Phase 2 (integration).

Modules (imported on demand; this package imports nothing heavy, so the trial subprocess starts
fast and sets its memory limit before torch loads):
  * :mod:`.proc`        - child processes: framed pipes, deadlines, stop/continue, killing trees;
  * :mod:`.child`       - the untrusted trial subprocess (applies mechanisms, builds, decodes);
  * :mod:`.trial`       - one trial: forcing, interleaved timing, PASS / MISMATCH / TIMEOUT / CRASH;
  * :mod:`.reference`   - the trusted AR reference and its cache;
  * :mod:`.executors`   - local process pool and Ray actors;
  * :mod:`.memory`      - SQLite mechanism memory;
  * :mod:`.search`      - candidates: memory priors, then Optuna ask/tell;
  * :mod:`.journal`     - the run directory's durable journal (resume);
  * :mod:`.coordinator` - the loop;
  * :mod:`.report`      - report.html.
"""
