"""The pilot loop (``specpilot optimize``): a trusted harness that token-forces and times candidate
plans in subprocesses, executors that run trials in parallel, the mechanism memory, and the
coordinator that ties Phase 0 (cost model), Phase 1 (exploration) and Phase 2 (integration).

Modules (imported on demand; this package imports nothing heavy, so the trial subprocess starts
fast and sets its memory limit before torch loads):
  * :mod:`.proc`        - child processes: framed pipes, deadlines, abort, stop/continue, trees;
  * :mod:`.sandbox`, :mod:`.landlock` - the sandbox of children that import untrusted code;
  * :mod:`.child`       - the untrusted trial subprocess (applies mechanisms, builds, decodes);
  * :mod:`.steps`       - the mechanisms the pilot knows and applying them to a plan;
  * :mod:`.decoder`     - a plan built in the child (``runtime.build`` + ``wrap_decode`` hooks);
  * :mod:`.trial`       - one trial: forcing, interleaved timing, PASS / MISMATCH / TIMEOUT /
                          CRASH / INTERRUPTED;
  * :mod:`.reference`   - the trusted AR reference and its cache;
  * :mod:`.executors`   - local process pool and Ray actors;
  * :mod:`.memory`      - SQLite mechanism memory;
  * :mod:`.records`     - the typed records of a run (journal and round log format);
  * :mod:`.journal`     - the run directory's durable journal and its replay (resume);
  * :mod:`.search`      - candidates: memory priors, then Optuna ask/tell;
  * :mod:`.explorer`    - the :class:`~.explorer.Explorer` protocol and the built-in explorer;
  * :mod:`.choosing`    - directions, a round's candidates, Phase 1 winners;
  * :mod:`.running`     - trials and profiles through the executor, within budget, until stopped;
  * :mod:`.recording`   - journal, memory, state and outputs;
  * :mod:`.honesty`     - the cost model's ceiling on a believable speedup;
  * :mod:`.recall`      - memory's remembered winners, stacked, as the first round;
  * :mod:`.events`      - what a run reports to its caller;
  * :mod:`.coordinator` - the loop;
  * :mod:`.report`      - report.html (jinja2 template in ``templates/``).
This package never imports :mod:`specpilot.agent`: the CLI wires the agents in as an extra
explorer (layer order: costmodel < pilot < agent).
"""
