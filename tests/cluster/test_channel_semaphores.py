"""What an embedded Ray's compiled-graph channels leave in /dev/shm: their semaphores, named
after the raylet, which only its clean exit would unlink. ``RayHandle.shutdown`` removes them
once that raylet has exited, and never one of a process still alive. The files here are empty
stand-ins in a temporary directory (the real ones are what a graph made; deleting them from
under a live session's channels is exactly what must not happen)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from raykv.cluster.runtime import remove_channel_semaphores


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def _make(directory: Path, pid: int) -> list[Path]:
    paths = [directory / f"sem.{kind}{pid}-{n}" for kind in ("hdr", "obj") for n in range(3)]
    for path in paths:
        path.write_bytes(b"\0" * 32)
    return paths


def test_the_semaphores_of_an_exited_raylet_are_removed_and_no_others(tmp_path: Path) -> None:
    gone = _exited_pid()
    alive = os.getpid()
    theirs = _make(tmp_path, gone)
    live = _make(tmp_path, alive)
    # a pid that only begins like the exited one is another process's
    other = tmp_path / f"sem.hdr{gone}7-1"
    other.write_bytes(b"")
    unrelated = tmp_path / f"raykv-{gone}-r0g0.pool"
    unrelated.write_bytes(b"")
    assert remove_channel_semaphores(gone, tmp_path) == len(theirs)
    assert not any(p.exists() for p in theirs)
    assert all(p.exists() for p in [*live, other, unrelated])


def test_a_process_still_alive_keeps_its_semaphores(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("raykv.cluster.runtime.RAYLET_EXIT_S", 0.2)
    live = _make(tmp_path, os.getpid())
    assert remove_channel_semaphores(os.getpid(), tmp_path) == 0
    assert all(p.exists() for p in live)


def test_the_test_sessions_raylet_is_known(ray_session) -> None:
    # what shutdown needs to find the files: the embedded instance's raylet, alive now
    assert ray_session.started and ray_session.raylet_pid is not None
    os.kill(ray_session.raylet_pid, 0)
