"""``specpilot`` command line: the only place that prints. Library modules return data."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from specpilot import __version__
from specpilot.defaults import UNION_DEFAULTS
from specpilot.errors import ConfigError, SpecPilotError

DEFAULT_MODEL = "smollm2-135m"


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="HF model directory, .gguf file, or a known name (default: %(default)s)",
    )
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cpu)")
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weights/activations dtype; bf16/fp16 on GPU (default: float32)",
    )
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    g.add_argument(
        "--attention",
        default=None,
        choices=["auto", "fixed", "exact", "sdpa"],
        help="fixed = batch-invariant fp32 kernel; exact = fp64 batch-invariant attention; "
        "sdpa = native (default: auto, fixed on CPU, exact when the kernels cannot build)",
    )
    g.add_argument(
        "--fixed-width",
        type=int,
        default=None,
        help="run every step, plain or verifying a chain, as one forward of exactly N "
        "rows over the whole cache: lossless by construction with kernels that are not "
        "batch-invariant (GPU); 0 = off (default: on CUDA the longest chain + 1 with CUDA "
        "graphs, off on CPU, whose kernels keep a fixed order)",
    )
    g.add_argument(
        "--linear",
        default=None,
        choices=["onednn", "torch"],
        help="CPU fp32 GEMM backend (default: onednn, prepacked and batch-invariant)",
    )
    g.add_argument(
        "--weights",
        default=None,
        choices=["auto", "fp32", "native"],
        help="GGUF weights: native = projections, LM head and embedding run on the file's "
        "blocks (specpilot.kernels, fixed-order fp32 kernels); fp32 = dequantized (oneDNN); "
        "auto = native on CPU float32 when the kernels build, else fp32 (default: auto; fp32 "
        "with --peers hf)",
    )
    g.add_argument(
        "--numerics",
        default=None,
        choices=["fp32", "int8"],
        help="numerics profile of native GGUF weights: fp32 = fp32 activations; int8 = "
        "activations quantized per block of 32, integer block dot products (default: fp32)",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")


def _drafter_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculation")
    g.add_argument(
        "--drafter",
        action="append",
        metavar="{none,lookup,suffix,model,head,head+suffix,DIR,DIR+suffix}",
        help="none = plain decoding; lookup = prompt n-gram lookup; suffix = suffix "
        "tree over prompt and earlier outputs; model = a draft model; head = the trained head "
        "shipped for the target; DIR = a trained drafter directory (specpilot train-drafter) "
        "(default: head+suffix with a dynamic tree of 10 nodes where a trained head ships for "
        "the target, else suffix with a chain of 5; bench takes several)",
    )
    g.add_argument("--draft-model", default=None, help="draft model for --drafter model")
    g.add_argument(
        "--tree",
        action="append",
        choices=["chain", "static", "dynamic"],
        help="draft tree shape (default: the default drafter's, see --drafter); bench takes "
        "several",
    )
    g.add_argument("--k", type=int, default=None, help="chain length for --tree chain (5)")
    g.add_argument(
        "--paths",
        default=None,
        help="static tree index paths, e.g. '0;1;0.0;0.1' or JSON [[0],[1],[0,0]]",
    )
    g.add_argument("--budget", type=int, default=None, help="node budget N, --tree dynamic (16)")
    g.add_argument("--topk", type=int, default=None, help="children per node, --tree dynamic (4)")
    g.add_argument("--depth", type=int, default=None, help="max depth for --tree dynamic (8)")
    g.add_argument(
        "--union-trust",
        type=int,
        default=None,
        help="X+suffix drafters: a suffix match of at least this many tokens drafts alone, "
        f"without running the trained drafter; 0 = always merge both (default: "
        f"{UNION_DEFAULTS['trust']})",
    )
    g.add_argument(
        "--union-depth",
        type=int,
        default=None,
        help="X+suffix drafters: cut the trained drafter's trees to this depth; 0 = the tree's "
        f"own (default: {UNION_DEFAULTS['trained_depth']})",
    )
    g.add_argument(
        "--head-min-prob",
        type=float,
        default=None,
        help="trained head drafters: do not expand draft nodes whose path probability under the "
        "drafter is below this (saves head forwards); 0 = expand all the tree allows (default: "
        f"{UNION_DEFAULTS['min_prob']} in X+suffix, 0 alone)",
    )
    g.add_argument(
        "--goodput",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="choose the verify budget per step by expected tokens per second, down to plain "
        "decoding where drafting does not pay (the goodput_budget mechanism; default: on for "
        "native GGUF weights on CPU, off otherwise)",
    )
    g.add_argument("--lookup-min-n", type=int, default=None, help="lookup: shortest n-gram (1)")
    g.add_argument("--lookup-max-n", type=int, default=None, help="lookup: longest n-gram (4)")


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--plan",
        default=None,
        help="a plan file, or a run directory holding plan.json (specpilot optimize): sets the "
        "drafter, tree and engine (not combinable with the flags that set those)",
    )


def _workload_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", default=None, help="humaneval or chat (default: humaneval)")
    src.add_argument(
        "--prompts", default=None, help='JSONL file, one {"id", "prompt", "chat"} object per line'
    )
    p.add_argument("--limit", type=int, default=None, help="take the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="specpilot",
        description="Lossless speculative decoding: generate, benchmark, profile.",
    )
    p.add_argument("--version", action="version", version=f"specpilot {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    g = sub.add_parser(
        "generate",
        help="generate text for one prompt, streaming",
        description="Generate text for one prompt; prints tau at the end.",
    )
    _model_args(g)
    _drafter_args(g)
    _plan_args(g)
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="apply the model's chat template (default: on)",
    )
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    s = g.add_argument_group("sampling (lossless: output distributed as the target's)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")

    for mod in _command_modules():
        mod.add_parser(sub).set_defaults(run=mod.run)
    return p


def _command_modules() -> list[Any]:
    """Every ``specpilot.cli_*`` module: each adds one subcommand with ``add_parser(sub)`` (which
    returns its parser) and runs it with ``run(args) -> exit code``. Imported here, not at the top:
    they import this module's shared flag helpers."""
    import importlib
    import pkgutil

    import specpilot

    names = sorted(
        m.name for m in pkgutil.iter_modules(specpilot.__path__) if m.name.startswith("cli_")
    )
    return [importlib.import_module(f"specpilot.{n}") for n in names]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "generate":
            return _cmd_generate(args)
        return int(args.run(args))
    except SpecPilotError as e:
        if args.debug:
            raise
        print(f"specpilot: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specpilot: interrupted", file=sys.stderr)
        return 130


def _setup(
    args: argparse.Namespace, hf_peers: bool = False
) -> tuple[Any, Any, list[Any], list[Any]]:
    """(loaded, engine, candidates, peers) through :func:`specpilot.plan_setup.setup`: the flags
    or ``--plan`` become plans built by the plan runtime; a bad flag fails before loading."""
    from specpilot.plan_setup import setup
    from specpilot.runtime import gpu_lossless_note

    s = setup(args, hf_peers)
    gpu_note = gpu_lossless_note(s.engine.cfg, bool(s.candidates))
    for note in (*s.loaded.notes, *([gpu_note] if gpu_note else [])):
        print(f"specpilot: note: {note}", file=sys.stderr)
    return s.loaded, s.engine, s.candidates, s.peers


def _cmd_generate(args: argparse.Namespace) -> int:
    from specpilot.engine import GenerationConfig
    from specpilot.tokenizer import StreamDecoder

    if any(not s for s in args.stop):
        raise ConfigError("--stop needs a non-empty string (an empty one would stop at once)")
    loaded, engine, candidates, _ = _setup(args)
    cand = candidates[0] if candidates else None
    tok = loaded.tokenizer
    ids = tok.encode_prompt(args.prompt, chat=args.chat)
    note_chat_fallback(tok, [args.chat])
    gen = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        stop_on_eos=not args.ignore_eos,
        stop_strings=tuple(args.stop),
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    stream = StreamDecoder(tok)

    def on_tokens(new: list[int]) -> None:
        sys.stdout.write(stream.push(new))
        sys.stdout.flush()

    t = time.perf_counter()
    res = engine.generate(
        ids,
        gen,
        drafter=cand.make_drafter() if cand else None,
        spec=cand.spec if cand else None,
        eos_ids=tok.eos_ids,
        detok=tok.decode,
        on_tokens=on_tokens,
    )
    wall = time.perf_counter() - t
    sys.stdout.write(stream.flush() + "\n")
    print(
        f"[{len(res.tokens)} tokens, {len(res.tokens) / wall:.1f} tok/s, tau {res.tau:.2f}, "
        f"{res.steps} target steps, {cand.name if cand else 'no drafter'}, "
        f"stop: {res.stop_reason}]",
        file=sys.stderr,
    )
    return 0


def note_chat_fallback(tok: Any, chat_flags: list[bool]) -> None:
    """One line on stderr when chat prompts run as plain text (the model has no chat template)."""
    from specpilot.tokenizer import chat_fallback_notice

    note = chat_fallback_notice(tok, chat_flags)
    if note:
        print(f"specpilot: note: {note}", file=sys.stderr)


def progress_console() -> Any:
    from rich.console import Console

    return Console(stderr=True, width=None if sys.stderr.isatty() else 110)


def progress_bar(console: Any) -> Any:
    """A transient rich progress bar (description, bar, n/total, elapsed) on ``console``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
