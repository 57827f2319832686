#!/bin/sh
# Old (22253bf: engine in a worker thread) and new (this checkout) servers, alternating:
# bench/load_test.py --vs-plain, 3 rounds per run, 2 pairs. Run from the repository root with
# the old checkout at $OLD (git worktree add /tmp/wt_old 22253bf).
for pair in 1 2; do
  for side in old new; do
    src=$PWD/src; [ $side = old ] && src=$OLD/src
    PYTHONPATH=$src python bench/load_test.py --concurrency 32 --requests 32 --max-tokens 64 \
      --limit 32 --max-batch 8 --vs-plain --rounds 3 --no-compare-alone \
      --json bench/results/s36/server_ab_${side}_$pair.json -- --threads 2 --numerics int8 >/dev/null 2>&1
    echo "$side $pair rc $?"
  done
done
