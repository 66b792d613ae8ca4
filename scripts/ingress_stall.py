#!/usr/bin/env python3
"""Does a huge prompt stall the server for everyone else? ``raykv serve`` on an embedded Ray,
``GET /v1/models`` polled back to back, first alone (the baseline) and then while one client
posts a prompt of ``--prompt-bytes`` characters that the ingress must read, parse and tokenize
(a prompt that fits the length check but not the context: tokenized whole, then refused), in
the same run. Prints each phase's models latency (median and worst) and the big request's own
time and status.

Usage: python scripts/ingress_stall.py [--model PRESET|DIR|GGUF] [--prompt-bytes 600000]
       [--port 8190] [--seconds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import threading
import time
from typing import Any

from raykv.config import load_config


def poll(url: str, key: str | None, until: threading.Event | float) -> list[float]:
    """Seconds per ``GET /v1/models``, back to back, until the event is set (or the time)."""
    import httpx2 as httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    times = []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        while True:
            done = (
                until.is_set() if isinstance(until, threading.Event) else time.monotonic() > until
            )
            if done:
                return times
            started = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            times.append(time.perf_counter() - started)


def describe(name: str, times: list[float]) -> str:
    if not times:
        return f"{name:>24}: no request completed"
    return (
        f"{name:>24}: {len(times):5d} answers, median {statistics.median(times) * 1000:7.1f} ms, "
        f"worst {max(times) * 1000:7.1f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-bytes", type=int, default=600_000)
    parser.add_argument("--port", type=int, default=8190)
    parser.add_argument("--seconds", type=float, default=3.0, help="the baseline's length")
    args = parser.parse_args(argv)
    from raykv.serve.app import ServeOptions, Server

    cfg = load_config(None, [f"model.path={args.model}", "model.dtype=float32"])
    with Server(cfg, ServeOptions(port=args.port)) as server:
        baseline = poll(server.url, None, time.monotonic() + args.seconds)
        # the big request from a process of its own: encoding and sending a megabyte in this
        # one would hold the poller's GIL and count against the server
        spawn = multiprocessing.get_context("spawn")  # not a fork of a process running Ray
        results = spawn.Queue()
        sender = spawn.Process(target=_post_big, args=(server.url, args.prompt_bytes, results))
        done = threading.Event()
        sender.start()
        waiter = threading.Thread(target=lambda: (sender.join(), done.set()))
        waiter.start()
        during = poll(server.url, None, done)
        waiter.join()
        seconds, status = results.get(timeout=60)
    print(describe("alone", baseline))
    print(describe(f"beside {args.prompt_bytes:,} chars", during))
    print(f"{'the big request':>24}: {seconds:.2f} s, HTTP {status}")
    return 0


def _post_big(url: str, size: int, results: Any) -> None:
    import httpx2 as httpx

    text = ("The history of the city begins in a small village by the river. " * 20_000)[:size]
    body = json.dumps({"prompt": text, "max_tokens": 1}).encode()
    started = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as client:
        answer = client.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
    results.put((time.perf_counter() - started, answer.status_code))


if __name__ == "__main__":
    sys.exit(main())
