"""Bounded load test of ``specpilot serve``: N concurrent streaming requests from the official
``openai`` client against a loopback server; reports errors, p50/p99 latency, time to first
token and tokens/s.

    python bench/load_test.py --concurrency 32 --requests 32 --max-tokens 64 --limit 32
    python bench/load_test.py --base-url http://127.0.0.1:8000/v1   # an already running server

Without --base-url the script starts ``specpilot serve`` itself (a free loopback port; extra
flags after ``--`` go to serve) and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(port: int, args: argparse.Namespace, extra: list[str]) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "specpilot.cli", "serve", "--model", args.model,
        "--port", str(port), "--max-batch", str(args.max_batch), "--log-level", "warning",
        *(["--drafter", args.drafter] if args.drafter else []), *extra,
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
                    ttft = ttft or time.perf_counter() - t0
        return One(True, time.perf_counter() - t0, ttft, chunks, usage)
    except Exception as e:  # counted and reported, never hidden
        return One(False, time.perf_counter() - t0, ttft, chunks, usage, f"{type(e).__name__}: {e}")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else 0.0


def main() -> int:
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
    args, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    prompts = load_workload(args.workload, limit=args.limit)
    proc = None
    base = args.base_url
    if base is None:
        port = _free_port()
        proc = _start_server(port, args, extra)
        base = f"http://127.0.0.1:{port}/v1"
    try:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        work = [prompts[i % len(prompts)] for i in range(args.requests)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            res = list(
                pool.map(lambda p: _request(client, model, p.text, p.chat, args.max_tokens), work)
            )
        wall = time.perf_counter() - t0
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics", timeout=10).text
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    ok = [r for r in res if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    tau = next(
        (ln.split()[-1] for ln in metrics.splitlines() if ln.startswith("specpilot_tau ")), ""
    )
    report = {
        "requests": len(res),
        "concurrency": args.concurrency,
        "errors": len(res) - len(ok),
        "latency_p50_s": _pct([r.latency_s for r in ok], 0.5),
        "latency_p99_s": _pct([r.latency_s for r in ok], 0.99),
        "ttft_p50_s": _pct([r.ttft_s for r in ok], 0.5),
        "ttft_p99_s": _pct([r.ttft_s for r in ok], 0.99),
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "server_tau": float(tau) if tau else None,
        "error_samples": [r.error for r in res if not r.ok][:5],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(
            json.dumps({**report, "runs": [asdict(r) for r in res]}, indent=2)
        )
    return 0 if report["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
