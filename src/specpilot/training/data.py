"""Training and held-out prompt sources for drafter distillation (offline, generated, small).

Sources (all built here, nothing downloaded; disjoint from HumanEval and the ``chat`` workload,
checked by :func:`check_disjoint` and the tests):

* ``code`` - HumanEval-like completion prompts from Python's own standard library: a function's
  signature and docstring (the target writes the body), found with :mod:`ast`.
* ``chat`` - self-instruct style instructions: templates over topic lists, wrapped in the target's
  chat template when encoded.
* ``text`` - teacher-forced chunks of standard-library source (no generation needed).
* a JSONL prompts file (the workload format) for users' own prompts.

Prompts are shuffled with a seed and split into training and held-out prompts by id.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from specpilot.errors import WorkloadError
from specpilot.workloads import Prompt, load_workload

SOURCES = ("code", "chat", "text")

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages"}

CHAT_TEMPLATES = (
    "Explain {t} to a beginner in a few short paragraphs.",
    "Write a short poem about {t}.",
    "Give three interesting facts about {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "Summarize the history of {t} in one paragraph.",
    "Write a short story for children that involves {t}.",
    "How would you teach a ten-year-old about {t}? Give a simple plan.",
    "List five common misconceptions about {t} and correct each one.",
    "Write a friendly email inviting a colleague to a talk about {t}.",
    "Describe {t} in exactly three sentences.",
    "What questions should someone ask before learning about {t}?",
    "Compare {t} with something from everyday life and explain the analogy.",
    "Write a haiku about {t}, then explain the imagery.",
    "Give a step-by-step guide for getting started with {t}.",
    "Why is {t} important? Answer in a short essay.",
    "Create a multiple-choice quiz with three questions about {t}.",
    "Write a product description for a board game themed around {t}.",
    "What would the world look like without {t}? Speculate briefly.",
    "Write a Python function related to {t} and explain how it works.",
    "Give a one-paragraph definition of {t} and an example.",
)

CHAT_TOPICS = (
    "volcanoes",
    "the water cycle",
    "black holes",
    "honeybees",
    "the Roman Empire",
    "chess",
    "machine learning",
    "recycling",
    "the human heart",
    "rainforests",
    "electric cars",
    "the Moon landing",
    "coral reefs",
    "the stock market",
    "jazz music",
    "origami",
    "public libraries",
    "sourdough bread",
    "the Great Wall of China",
    "earthquakes",
    "penguins",
    "solar panels",
    "the Olympic Games",
    "coffee",
    "bicycles",
    "the internet",
    "dinosaurs",
    "tea ceremonies",
    "glaciers",
    "cryptography",
    "the printing of money",
    "lighthouses",
    "sleep",
    "meditation",
    "the periodic table",
    "wind turbines",
    "ancient Egypt",
    "robots",
    "gardening",
    "the immune response to colds",
    "rivers",
    "deserts",
    "octopuses",
    "maps",
    "clocks",
    "the violin",
    "marathons",
    "budgeting",
    "friendship",
    "video games",
    "mountain climbing",
    "bridges",
    "satellites",
    "the metric system",
    "mushrooms",
    "vaccination history",
    "thunderstorms",
    "the alphabet",
    "museums",
    "trains",
    "kites",
    "composting",
    "the Renaissance",
    "smartphones",
    "elephants",
    "sea turtles",
    "soap",
    "rainbows",
    "airplanes",
    "the Sahara",
    "magnets",
    "batteries",
    "cheese making",
    "the Amazon river",
    "owls",
    "tides",
    "recycling plastic",
    "time zones",
    "fireworks",
    "the Silk Road",
    "cloud computing",
    "open source software",
    "databases",
    "sorting algorithms",
    "prime numbers",
    "fractions",
    "probability",
    "geometry",
    "calendars",
    "weather forecasts",
    "bees and pollination",
    "paper making",
    "glass blowing",
    "pottery",
    "the piano",
    "national parks",
    "hiking safety",
    "first aid",
    "healthy breakfasts",
    "learning a language",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _py_files(root: Path) -> list[Path]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in _SKIP_DIRS or part.startswith("test") for part in rel[:-1]):
            continue
        if p.name.startswith("test_"):
            continue
        out.append(p)
    return out


def code_prompts(root: Path | None = None, limit: int | None = None) -> list[Prompt]:
    """Signature + docstring of standard-library functions that have a body after it."""
    root = root or stdlib_root()
    out: list[Prompt] = []
    for path in _py_files(root):
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
                continue
            doc = ast.get_docstring(node)
            first = node.body[0]
            if doc is None or not 30 <= len(doc) <= 700 or first.end_lineno is None:
                continue
            start = node.lineno - 1 - len(node.decorator_list)
            if first.end_lineno - start > 30:
                continue
            chunk = lines[start : first.end_lineno]
            indent = len(chunk[0]) - len(chunk[0].lstrip())
            text = "\n".join(line[indent:] for line in chunk) + "\n"
            rel = path.relative_to(root).as_posix()
            out.append(Prompt(id=f"stdlib/{rel}:{node.lineno}", text=text, chat=False))
            if limit is not None and len(out) >= limit:
                return out
    return out


def chat_prompts(seed: int = 0) -> list[Prompt]:
    """Every template x topic instruction, in a seeded order."""
    out = [
        Prompt(id=f"instr/{i}/{j}", text=t.format(t=topic), chat=True)
        for i, t in enumerate(CHAT_TEMPLATES)
        for j, topic in enumerate(CHAT_TOPICS)
    ]
    random.Random(seed).shuffle(out)
    return out


def text_chunks(root: Path | None = None, max_files: int = 400, seed: int = 0) -> list[str]:
    """Standard-library source files (teacher-forced text), one string per file."""
    files = _py_files(root or stdlib_root())
    random.Random(seed).shuffle(files)
    out = []
    for p in files[:max_files]:
        try:
            out.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def load_prompts(sources: Sequence[str], seed: int = 0) -> list[Prompt]:
    """Prompts of the named sources (``code``, ``chat``) or JSONL files, interleaved by seed."""
    pools: list[list[Prompt]] = []
    for s in sources:
        if s == "code":
            pool = code_prompts()
            random.Random(seed).shuffle(pool)
        elif s == "chat":
            pool = chat_prompts(seed)
        elif s == "text":
            continue
        elif Path(s).suffix == ".jsonl" or Path(s).exists():
            pool = load_workload(prompts_file=s)
        else:
            raise WorkloadError(
                f"unknown training data source {s!r}: use code, chat, text or a JSONL prompts file"
            )
        pools.append(pool)
    merged: list[Prompt] = []
    for i in range(max((len(p) for p in pools), default=0)):
        merged.extend(p[i] for p in pools if i < len(p))
    return drop_overlapping(merged)


def split(prompts: Sequence[Prompt], n_eval: int, seed: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held out): ``n_eval`` prompts spread evenly over the list, disjoint by id."""
    if len(prompts) <= n_eval:
        raise WorkloadError(
            f"need more than {n_eval} training prompts to hold {n_eval} out, got {len(prompts)}"
        )
    step = len(prompts) / max(n_eval, 1)
    held_idx = {int(i * step) for i in range(n_eval)}
    held = [p for i, p in enumerate(prompts) if i in held_idx]
    train = [p for i, p in enumerate(prompts) if i not in held_idx]
    return train, held


def _ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _benchmark_ngrams(n: int) -> tuple[set[tuple[str, ...]], set[str]]:
    bench: set[tuple[str, ...]] = set()
    texts: set[str] = set()
    for name in ("humaneval", "chat"):
        for p in load_workload(name):
            bench |= _ngrams(p.text, n)
            texts.add(p.text.strip())
    return bench, texts


def drop_overlapping(prompts: Sequence[Prompt], n: int = 8) -> list[Prompt]:
    """The prompts that share no ``n``-word run with (and do not equal) a HumanEval or ``chat``
    workload prompt: the benchmarks' prompts are never trained on."""
    bench, texts = _benchmark_ngrams(n)
    return [p for p in prompts if p.text.strip() not in texts and not _ngrams(p.text, n) & bench]


def check_disjoint(prompts: Sequence[Prompt], n: int = 8) -> None:
    """WorkloadError if a prompt equals or shares an ``n``-word run with a benchmark prompt."""
    bench, texts = _benchmark_ngrams(n)
    for p in prompts:
        if p.text.strip() in texts or _ngrams(p.text, n) & bench:
            raise WorkloadError(
                f"training prompt {p.id!r} overlaps a benchmark prompt (HumanEval or chat); "
                "remove it from the training data"
            )


def iter_batches(items: Sequence[list[int]], size: int) -> Iterator[list[list[int]]]:
    for i in range(0, len(items), size):
        yield list(items[i : i + size])


def text_windows(tok: Any, text_tokens: int, window: int, seed: int) -> list[list[int]]:
    """``text_tokens // window`` windows of ``window`` token ids cut from :func:`text_chunks`."""
    out: list[list[int]] = []
    need = text_tokens // window
    for text in text_chunks(seed=seed):
        ids = tok.encode(text)
        for i in range(0, len(ids) - window + 1, window):
            out.append(ids[i : i + window])
            if len(out) >= need:
                return out
    return out
