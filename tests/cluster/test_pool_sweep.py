"""Shard files of crashed runs are swept on every node, not only on the driver's host: a rank
sweeps its node's directory when it starts. A file is removed only when no live process holds
it and, where its run's owner process can be seen (same host), that owner is gone; a sweeping
rank never touches its own run's files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import ray

from raykv.transfer.pool_files import PoolFiles, hold, sweep_stale

pytestmark = pytest.mark.timeout(300)


def foreign(directory: str, rank: int = 0) -> str:
    """The shard file a run driven from another host left on this one (its owner pid means
    nothing here)."""
    path = PoolFiles(directory, "elsewhere-4242-0123abcd").path(rank)
    with open(path, "wb") as fh:
        fh.write(b"\0" * 4096)
    return path


def test_files_of_runs_driven_from_another_host_are_swept_when_nobody_holds_them(tmp_path):
    d = str(tmp_path)
    orphan = foreign(d)
    assert sweep_stale(d) == [orphan]
    assert not os.listdir(d)


def test_a_held_file_stays_whoever_owns_its_run(tmp_path) -> None:
    d = str(tmp_path)
    held = foreign(d, rank=1)
    # a live rank in another process holds its shard (as every Ray rank does while it runs)
    code = "import sys, time; from raykv.transfer.pool_files import hold; hold(sys.argv[1]); "
    code += "print('held', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, held], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert sweep_stale(d) == []
        assert os.path.exists(held)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert sweep_stale(d) == [held]  # its holder is gone: now it goes


def test_a_sweep_keeps_its_own_runs_files_and_those_of_live_owners_here(tmp_path) -> None:
    d = str(tmp_path)
    mine = PoolFiles(d, "elsewhere-4242-0123abcd")
    own = foreign(d)  # the sweeping rank's own run: a dead rank's shard waits for its successor
    live = PoolFiles.new(d).path(0)  # owned by this (live) process on this host
    open(live, "wb").close()
    assert sweep_stale(d, keep_owner=mine.owner) == []
    assert sorted(os.listdir(d)) == sorted(os.path.basename(p) for p in (own, live))


def test_hold_locks_the_file_now_at_the_path(tmp_path) -> None:
    path = PoolFiles.new(str(tmp_path)).path(0)
    fd = hold(path)
    try:
        assert fd is not None and os.fstat(fd).st_ino == os.stat(path).st_ino
    finally:
        os.close(fd)
    assert hold(str(tmp_path / "missing-dir" / "x.pool")) is None


def test_every_rank_sweeps_its_own_node_when_it_starts(ray_session, tmp_path, monkeypatch):
    from raykv.cluster.rank_actor import READY_TIMEOUT_S, spawn_rank_worker
    from raykv.config import load_config
    from tests.cluster.test_ray_engine import SMALL

    d = str(tmp_path)
    orphan = foreign(d)
    cfg = load_config(None, [*SMALL, f"offload.shared_pool_dir={d}"])
    files = PoolFiles.new(d)
    # a rank alone, no client (whose own sweep runs only where the driver is)
    rank = spawn_rank_worker(cfg.model_dump(mode="json"), 0, 0, None, files.path(0))
    try:
        info = ray.get(rank.ready.remote(), timeout=READY_TIMEOUT_S)
        assert info.pool_path == files.path(0)
        assert sorted(os.listdir(d)) == [os.path.basename(files.path(0))]  # the orphan is gone
        # seen from another host (where this driver's pid means nothing), the live rank's
        # shard is held: no sweep removes it
        monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
        assert sweep_stale(d) == [] and os.path.exists(files.path(0))
        ray.kill(rank, no_restart=True)
        deadline = time.monotonic() + 30  # once its process exits, its lock goes with it
        while os.path.exists(files.path(0)) and time.monotonic() < deadline:
            sweep_stale(d)
            time.sleep(0.2)
        assert not os.path.exists(files.path(0))
    finally:
        ray.kill(rank, no_restart=True)
    assert not os.path.exists(orphan)
