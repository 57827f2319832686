"""Bounded load test of ``specpilot serve``: N concurrent streaming requests from the official
``openai`` client against a loopback server; reports errors, p50/p99 latency, time to first
token and tokens/s.

    python bench/load_test.py --concurrency 32 --requests 32 --max-tokens 64 --limit 32
    python bench/load_test.py --base-url http://127.0.0.1:8000/v1   # an already running server
    python bench/load_test.py --concurrency 32 --vs-plain    # speculation vs plain decoding

Without --base-url the script starts ``specpilot serve`` itself (a free loopback port; extra
flags after ``--`` go to serve) and stops it at the end.

Outputs are checked: after the concurrent run, every distinct prompt is sent again alone (one
request at a time, same settings) and its text at temperature 0 must equal the text it got
under load (``mismatches`` in the report; ``--no-compare-alone`` skips it). ``--no-spec``
serves with plain decoding (``serve --drafter none``); ``--vs-plain`` runs the whole test twice,
speculative then plain, on the same requests, and reports the throughput ratio and whether
the two servers' outputs agree. ``--rounds R`` runs the concurrent requests R times per server;
with ``--vs-plain`` both servers stay up (started one after the other, each calibrating on a
quiet machine) and the rounds alternate ABBA (speculative, plain, plain, speculative, ...), so
a disturbed moment hits both and a steady drift weighs on both alike; tokens/s is the median
over rounds (one 32 x 64 round on 2 cores swings by ~20%, with the load generator on the same
cores), ``tokens_per_s_total`` all rounds' tokens over their summed
wall time (``throughput_ratio_total`` with ``--vs-plain``). Each server's report also splits its
side of the rounds by its /metrics: batched steps (``server_steps``, ``server_step_s``; of it
drafting, ``server_draft_s``, by what drafted, with ``server_drafted_steps``, and the verify
forward, ``server_verify_s``) and admissions (``server_prefill_s``) against ``rounds_wall_s``.
The exit status is 1 on any error or mismatch.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai

from specpilot.workloads import load_workload


@dataclass
class One:
    ok: bool
    latency_s: float
    ttft_s: float
    chunks: int
    completion_tokens: int
    error: str = ""
    text: str = ""
    prompt: int = -1
    """Index of the distinct prompt this request sent."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(
    port: int, args: argparse.Namespace, extra: list[str], spec: bool = True
) -> subprocess.Popen:
    drafter = args.drafter if spec else "none"
    cmd = [
        sys.executable, "-m", "specpilot.cli", "serve", "--model", args.model,
        "--port", str(port), "--max-batch", str(args.max_batch), "--log-level", "warning",
        *(["--drafter", drafter] if drafter else []), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.time() + args.startup_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy in time")


def _request(client: openai.OpenAI, model: str, text: str, chat: bool, max_tokens: int) -> One:
    t0 = time.perf_counter()
    ttft, chunks, usage = 0.0, 0, 0
    pieces: list[str] = []
    try:
        common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True)
        common["stream_options"] = {"include_usage": True}
        if chat:
            msgs = [{"role": "user", "content": text}]
            stream = client.chat.completions.create(messages=msgs, **common)
        else:
            stream = client.completions.create(prompt=text, **common)
        for ch in stream:
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
            if ch.choices:
                piece = ch.choices[0].delta.content if chat else ch.choices[0].text
                if piece:
                    chunks += 1
                    pieces.append(piece)
                    ttft = ttft or time.perf_counter() - t0
        return One(True, time.perf_counter() - t0, ttft, chunks, usage, text="".join(pieces))
    except Exception as e:  # counted and reported, never hidden
        return One(False, time.perf_counter() - t0, ttft, chunks, usage, f"{type(e).__name__}: {e}")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else 0.0


def _args() -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", default=None, help="use a running server (…/v1)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workload", default="humaneval")
    ap.add_argument("--limit", type=int, default=None, help="distinct prompts (cycled)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write the report to this file")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="concurrent rounds per server (with --vs-plain both servers stay up and the rounds "
        "alternate); tokens/s and the ratio are medians over rounds",
    )
    ap.add_argument(
        "--no-compare-alone",
        dest="compare_alone",
        action="store_false",
        help="skip re-sending each prompt alone to compare outputs",
    )
    ap.add_argument(
        "--no-spec", action="store_true", help="serve with plain decoding (serve --drafter none)"
    )
    ap.add_argument(
        "--vs-plain",
        action="store_true",
        help="run speculative and plain servers on the same requests, compare",
    )
    args, extra = ap.parse_known_args()
    if args.base_url and args.vs_plain:
        raise SystemExit("--vs-plain starts its own servers; drop --base-url")
    if args.no_spec and args.vs_plain:
        raise SystemExit("--vs-plain runs both ways already; drop --no-spec")
    return args, [x for x in extra if x != "--"]


def _run(client: openai.OpenAI, model: str, work: list, args: argparse.Namespace) -> list[One]:
    """All requests of ``work`` ((prompt index, prompt)) at ``args.concurrency``."""

    def one(item: tuple[int, object]) -> One:
        i, p = item
        r = _request(client, model, p.text, p.chat, args.max_tokens)
        r.prompt = i
        return r

    with ThreadPoolExecutor(args.concurrency) as pool:
        return list(pool.map(one, work))


def _mismatches(res: list[One], alone: dict[int, One]) -> list[dict]:
    """Requests whose text under load differs from the same prompt's text sent alone."""
    out = []
    for r in res:
        a = alone.get(r.prompt)
        if r.ok and a is not None and a.ok and r.text != a.text:
            out.append({"prompt": r.prompt, "under_load": r.text[:200], "alone": a.text[:200]})
    return out


@contextmanager
def _server(args: argparse.Namespace, extra: list[str], spec: bool) -> Iterator[tuple]:
    """(client, model id, base url) of a server started here (unless --base-url), stopped on
    exit."""
    proc = None
    base = args.base_url
    if base is None:
        port = _free_port()
        proc = _start_server(port, args, extra, spec)
        base = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
        yield client, client.models.list().data[0].id, base
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


def _concurrent(server: tuple, prompts: list, args: argparse.Namespace) -> tuple[list[One], float]:
    """One round: every request at ``args.concurrency``; (results, wall seconds)."""
    client, model, _ = server
    n = min(len(prompts), args.requests)
    work = [(i % n, prompts[i % n]) for i in range(args.requests)]
    t0 = time.perf_counter()
    res = _run(client, model, work, args)
    return res, time.perf_counter() - t0


def _finish(
    server: tuple, prompts: list, args: argparse.Namespace, rounds: list, spec: bool
) -> dict:
    """The server's metrics and, unless --no-compare-alone, each distinct prompt sent alone;
    the report over ``rounds`` ((results, wall) per round)."""
    client, model, base = server
    metrics = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
    alone: dict[int, One] = {}
    if args.compare_alone:
        for i in range(min(len(prompts), args.requests)):  # one at a time: nothing else batched
            alone[i] = _request(client, model, prompts[i].text, prompts[i].chat, args.max_tokens)
    return _report(args, rounds, metrics, alone, spec)


def _sample(metrics: str, name: str) -> float | None:
    """The value of the sample ``name`` in a /metrics body (None: the server has no such one)."""
    for ln in metrics.splitlines():
        if ln.startswith(name + " "):
            return float(ln.split()[-1])
    return None


def _labelled(metrics: str, name: str) -> dict[str, float]:
    """The samples ``name{label="value"}`` in a /metrics body, by label value."""
    out = {}
    for ln in metrics.splitlines():
        if ln.startswith(name + "{"):
            out[ln.split('"')[1]] = float(ln.split()[-1])
    return out


def _report(
    args: argparse.Namespace,
    rounds: list[tuple[list[One], float]],
    metrics: str,
    alone: dict[int, One],
    spec: bool,
) -> dict:
    """Latencies and outputs of the last round; tokens/s per round and their median."""
    res, wall = rounds[-1]
    ok = [r for r in res if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    per_round = [sum(r.completion_tokens for r in rr if r.ok) / w for rr, w in rounds]
    errors = sum(len(rr) - sum(r.ok for r in rr) for rr, _ in rounds)
    tau = _sample(metrics, "specpilot_tau")
    bad = [m for rr, _ in rounds for m in _mismatches(rr, alone)]
    alone_errors = [a.error for a in alone.values() if not a.ok]
    return {
        "speculative": spec,
        "requests": len(res),
        "concurrency": args.concurrency,
        "rounds": len(rounds),
        "tokens_per_s_rounds": per_round,
        "errors": errors + len(alone_errors),
        "latency_p50_s": _pct([r.latency_s for r in ok], 0.5),
        "latency_p99_s": _pct([r.latency_s for r in ok], 0.99),
        "ttft_p50_s": _pct([r.ttft_s for r in ok], 0.5),
        "ttft_p99_s": _pct([r.ttft_s for r in ok], 0.99),
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": statistics.median(per_round),
        "tokens_per_s_total": sum(sum(r.completion_tokens for r in rr if r.ok) for rr, _ in rounds)
        / max(sum(w for _, w in rounds), 1e-9),
        "server_tau": tau,
        "server_steps": _sample(metrics, "specpilot_steps_total"),
        "server_step_s": _sample(metrics, "specpilot_step_seconds_sum"),
        "server_draft_s": _labelled(metrics, "specpilot_draft_seconds_total"),
        "server_drafted_steps": _labelled(metrics, "specpilot_drafted_steps_total"),
        "server_verify_s": _sample(metrics, "specpilot_verify_seconds_total"),
        "server_prefill_s": _sample(metrics, "specpilot_prefill_seconds_sum"),
        "rounds_wall_s": sum(w for _, w in rounds),
        "compared_alone": len(alone),
        "mismatches": len(bad) if args.compare_alone else None,
        "mismatch_samples": bad[:3],
        "error_samples": ([r.error for r in res if not r.ok] + alone_errors)[:5],
        "runs": [asdict(r) for r in res],
    }


def main() -> int:
    args, extra = _args()
    prompts = load_workload(args.workload, limit=args.limit)
    sides = [not args.no_spec, *([False] if args.vs_plain else [])]
    with ExitStack() as stack:  # started one after another: each calibrates on a quiet machine
        servers = [stack.enter_context(_server(args, extra, s)) for s in sides]
        rounds: list[list] = [[] for _ in sides]
        pairs = list(zip(servers, rounds, strict=True))
        for r in range(args.rounds):  # interleaved ABBA: speculative, plain, plain, speculative..
            for srv, got in pairs if r % 2 == 0 else pairs[::-1]:
                got.append(_concurrent(srv, prompts, args))
        reports = [_finish(srv, prompts, args, got, s)
                   for srv, got, s in zip(servers, rounds, sides, strict=True)]  # fmt: skip
    summary = {k: v for k, v in reports[0].items() if k != "runs"}
    failed = any(r["errors"] or r["mismatches"] for r in reports)
    if args.vs_plain:
        spec_r, plain_r = reports
        plain = {k: v for k, v in plain_r.items() if k != "runs"}
        texts = {r["prompt"]: r["text"] for r in plain_r["runs"] if r["ok"]}
        differ = sum(
            1
            for r in spec_r["runs"]
            if r["ok"] and r["prompt"] in texts and r["text"] != texts[r["prompt"]]
        )
        sp, pl = spec_r["tokens_per_s"], plain_r["tokens_per_s"]
        pairs = zip(spec_r["tokens_per_s_rounds"], plain_r["tokens_per_s_rounds"], strict=True)
        summary = {
            "speculative": summary,
            "plain": plain,
            "throughput_ratio": sp / pl if pl else 0,
            "throughput_ratio_rounds": [a / b if b else 0 for a, b in pairs],
            "throughput_ratio_total": spec_r["tokens_per_s_total"] / plain_r["tokens_per_s_total"]
            if plain_r["tokens_per_s_total"]
            else 0,
            "spec_vs_plain_text_mismatches": differ,
        }
        failed = failed or differ > 0
    print(json.dumps(summary, indent=2))
    if args.json:
        full = {**summary, "reports": reports}
        Path(args.json).write_text(json.dumps(full, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
