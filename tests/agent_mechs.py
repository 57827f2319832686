"""A planted slow path for the agent loop tests: ``slow_path`` (kernel) sleeps 150 ms per request
unless its ``fast`` parameter is set - a large, certain gain for a mechanism that switches it."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from specpilot.mechanisms.base import Param

from .pilot_planted import Decode, Planted


class SlowPath(Planted):
    id = "slow_path"
    factor = "kernel"
    params = (Param("fast", "bool", False),)

    def wrap_decode(self, decode: Decode, params: Mapping[str, Any]) -> Decode:
        def run(ids: list[int], gen: Any) -> Any:
            if not params.get("fast") and gen.max_new_tokens > 8:
                time.sleep(0.15)
            return decode(ids, gen)

        return run


MECHANISMS = (SlowPath(),)
