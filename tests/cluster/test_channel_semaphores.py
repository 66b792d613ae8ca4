"""What an embedded Ray's compiled-graph channels leave in /dev/shm: their semaphores, named
after the raylet, which only its clean exit would unlink. ``RayHandle.shutdown`` removes them
once that raylet has exited, and starting an embedded instance sweeps those of runs that crashed
(issue 28, finding 8: a SIGKILLed run's raylet never exits cleanly, so nothing else ever would);
neither touches one of a process still alive. The files here are empty stand-ins in a temporary
directory (the real ones are what a graph made; deleting them from under a live session's
channels is exactly what must not happen)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from raykv.cluster import runtime
from raykv.cluster.runtime import remove_channel_semaphores, sweep_channel_semaphores


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


def _strangers(directory: Path, gone: int) -> list[Path]:
    """Files an exited pid's name is in, but not in the shape of a channel's semaphore."""
    names = [
        f"sem.hdr{gone}",  # no suffix
        f"sem.obj{gone}-12x",  # a suffix that is not Ray's timestamp
        f"sem.hdr{gone}-1.bak",
        f"sem.mp-{gone}-1",  # someone else's semaphore
        f"sem.hdr-{gone}-1",
        f"hdr{gone}-1",
        f"raykv-{gone}-r0g0.pool",
    ]
    for name in names:
        (directory / name).write_bytes(b"")
    return [directory / name for name in names]


def test_a_sweep_removes_the_semaphores_of_every_exited_process_and_nothing_else(
    tmp_path: Path,
) -> None:
    # a crashed run's raylet (SIGKILL): gone without unlinking, so its semaphores would stay
    crashed, other_crash = _exited_pid(), _exited_pid()
    theirs = [*_make(tmp_path, crashed), *_make(tmp_path, other_crash)]
    live = _make(tmp_path, os.getpid())  # a live raylet's: its channels may be in use
    strangers = _strangers(tmp_path, crashed)
    assert sweep_channel_semaphores(tmp_path) == len(theirs)
    assert not any(p.exists() for p in theirs)
    assert all(p.exists() for p in [*live, *strangers])
    assert sweep_channel_semaphores(tmp_path) == 0  # nothing left to sweep


def test_starting_an_embedded_ray_sweeps_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    crashed = _exited_pid()
    theirs = _make(tmp_path, crashed)
    live = _make(tmp_path, os.getpid())
    seen_at_init: list[bool] = []

    class Started:
        address_info: dict = {}

    def fake_init(**kwargs) -> Started:
        # the new instance's own raylet may get a dead run's pid: sweep before it exists
        seen_at_init.append(any(p.exists() for p in theirs))
        return Started()

    monkeypatch.setattr(runtime, "SEMAPHORE_DIR", tmp_path)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    handle = runtime.connect(num_cpus=1)
    assert handle.started and seen_at_init == [False]
    assert handle.swept_semaphores == len(theirs)
    assert all(p.exists() for p in live)


def test_joining_a_cluster_sweeps_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    # another instance's files, on a node this driver does not own
    theirs = _make(tmp_path, _exited_pid())
    monkeypatch.setattr(runtime, "SEMAPHORE_DIR", tmp_path)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: None)
    handle = runtime.connect("10.0.0.1:6379")
    assert not handle.started and handle.swept_semaphores == 0
    assert all(p.exists() for p in theirs)
