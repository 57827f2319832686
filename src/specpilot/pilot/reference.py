"""The trusted reference: plain autoregressive greedy outputs, computed and cached by the parent.

Only the coordinator computes references (in its own process, with the engine's default runtime
for the device: batch-invariant attention and GEMMs on CPU) and only it caches them; trial
children never see this cache. Entries are keyed by the model fingerprint, the prompt's token ids
and the generation settings, and appended to ``references.jsonl`` in the run directory (fsynced),
so a resumed run does not decode them again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specpilot.forcing import Reference


def reference_key(fingerprint: str, ids: Sequence[int], max_new_tokens: int, eos: bool) -> str:
    blob = json.dumps([fingerprint, list(ids), max_new_tokens, eos], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class ReferenceCache:
    """Reference outputs by prompt; decoded on demand by ``decode_fn`` and persisted."""

    def __init__(
        self,
        path: Path | None,
        fingerprint: str,
        max_new_tokens: int,
        stop_on_eos: bool,
        decode_fn: Callable[[list[int]], tuple[list[int], list[float]]],
    ) -> None:
        self.path, self.fingerprint = path, fingerprint
        self.max_new_tokens, self.stop_on_eos = max_new_tokens, stop_on_eos
        self.decode_fn = decode_fn
        self.entries: dict[str, tuple[tuple[int, ...], tuple[float, ...]]] = {}
        if path is not None and path.exists():
            for line in path.read_text().splitlines():
                try:
                    d = json.loads(line)
                    self.entries[d["key"]] = (tuple(d["tokens"]), tuple(d["margins"]))
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue  # a torn last line after a kill

    def _key(self, ids: Sequence[int]) -> str:
        return reference_key(self.fingerprint, ids, self.max_new_tokens, self.stop_on_eos)

    def missing(self, prompts: Sequence[tuple[str, Sequence[int]]]) -> list[tuple[str, list[int]]]:
        return [(pid, list(ids)) for pid, ids in prompts if self._key(ids) not in self.entries]

    def get(self, prompt_id: str, ids: Sequence[int]) -> Reference:
        """The reference of ``ids`` (decoded now if not cached)."""
        key = self._key(ids)
        if key not in self.entries:
            tokens, margins = self.decode_fn(list(ids))
            self.entries[key] = (tuple(tokens), tuple(margins))
            if self.path is not None:
                rec = {"key": key, "prompt_id": prompt_id, "tokens": tokens, "margins": margins}
                with open(self.path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
        tokens, margins = self.entries[key]
        return Reference(prompt_id, tokens, margins)

    def refs(self, prompts: Sequence[tuple[str, Sequence[int]]]) -> dict[str, Reference]:
        return {pid: self.get(pid, ids) for pid, ids in prompts}


def ar_decoder(
    loaded: Any, device: str, max_new_tokens: int, stop_on_eos: bool
) -> Callable[[list[int]], tuple[list[int], list[float]]]:
    """Plain AR greedy on ``loaded`` with the device's default engine runtime (margins on)."""
    from specpilot.engine import Engine, EngineConfig, GenerationConfig

    engine = Engine(loaded.model, EngineConfig(device=device))
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, stop_on_eos=stop_on_eos, record_margins=True
    )
    eos = tuple(loaded.tokenizer.eos_ids)

    def decode(ids: list[int]) -> tuple[list[int], list[float]]:
        res = engine.generate(ids, gen, eos_ids=eos)
        return list(res.tokens), [float(m) for m in res.margins]

    return decode
