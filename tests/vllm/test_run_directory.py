"""An engine's run directory: one left by an engine that died without its shutdown is removed by
the next engine that starts; one a live process holds is left alone."""

from __future__ import annotations

import fcntl
import os
import tempfile
import time

from raykv.vllm.run_directory import LOCK, engine_run_directory, release


def stale(base: str, name: str, held: bool) -> tuple[str, int | None]:
    path = os.path.join(base, f"vllm-{name}")
    os.makedirs(path, mode=0o700)
    with open(os.path.join(path, "bad-keys.rank0"), "w") as out:
        out.write("a000000000000000001\n")
    lock = os.path.join(path, LOCK)
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o600)
    old = time.time() - 3600
    os.utime(lock, (old, old))
    if held:
        fcntl.flock(fd, fcntl.LOCK_SH)
        return path, fd
    os.close(fd)
    return path, None


def test_a_dead_engine_s_directory_goes_and_a_live_one_s_stays(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = os.path.join(str(tmp_path), f"raykv-{os.getuid()}")
    os.makedirs(base, mode=0o700)
    dead, _ = stale(base, "dead", held=False)
    live, fd = stale(base, "live", held=True)
    mine = engine_run_directory("mine")
    try:
        assert not os.path.exists(dead)
        assert os.path.exists(os.path.join(live, "bad-keys.rank0"))
        assert os.path.isdir(mine)
    finally:
        release(mine)
        os.close(fd)
