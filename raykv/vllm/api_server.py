"""vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) as a process of
this one's: started in a session of its own, waited for until ``/health`` answers, and stopped
with its whole process group (its engine core too). The baseline of ``raykv bench serve
--router vllm`` and the ``vllm serve`` test drive it the same way."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# how much of its log a server that did not start shows
LOG_TAIL_CHARS = 3000
STOP_S = 60.0


class ServerDidNotStart(RuntimeError):
    """The server exited, or was not up in time; the message ends with its log's tail."""


@contextlib.contextmanager
def running(
    command: list[str], port: int, log: Path, env: dict[str, str], start_s: float
) -> Iterator[str]:
    """The server of ``command`` (listening on ``port`` of loopback, its output in ``log``) up;
    its base URL (``http://127.0.0.1:PORT``). ``ServerDidNotStart`` when it exits or is not up
    within ``start_s``."""
    with log.open("w") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_s
        while True:
            if server.poll() is not None:
                raise ServerDidNotStart(
                    f"vLLM's server exited ({server.returncode}):\n{_tail(log)}"
                )
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{url}/health", timeout=2) as reply,
            ):
                if reply.status == 200:
                    break
            if time.monotonic() > deadline:
                raise ServerDidNotStart(f"vLLM's server not up in {start_s} s:\n{_tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:]
