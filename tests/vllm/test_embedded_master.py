"""The engine's embedded master and the memory of its pool: given by the process that started the
master, beside it, and taken back before the master stops. At TP 2 and up a worker's process
starts the master, and vLLM shuts the workers down before the scheduler: a segment given by the
scheduler's process was let go from a master already stopped, which Mooncake's client retries
for about 15 s with Python's lock held. Here both halves are in this process, in that order."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

from raykv.config.shared import SharedTierConfig
from raykv.transfer.disk_files import ChunkFormat
from raykv.transfer.shared_store import SharedChunks, mooncake_problem
from raykv.vllm import shared
from tests.transfer.test_shared_store import FORMAT, identity


def test_the_master_s_process_gives_its_pool_memory_and_takes_it_back_first(
    tmp_path, caplog
) -> None:
    problem = mooncake_problem()
    if problem is not None:
        pytest.skip(f"Mooncake Store cannot start here: {problem}")
    settings = SharedTierConfig(enabled=True, segment=16 << 20)
    run_directory = str(tmp_path)
    where = shared.endpoint(settings, run_directory)  # this process starts the master
    view = shared.StoreView(settings, where, 1)  # as the scheduler would
    view.use_namespace("embedded-pool")
    try:
        assert view.segment is None  # the master's process gave the pool its memory
        memory = np.random.default_rng(3).integers(0, 255, (4, FORMAT.data_bytes), dtype=np.uint8)
        fmt = ChunkFormat(FORMAT.page_bytes, FORMAT.pages, identity("embedded-pool", 0, 1))
        parts = SharedChunks(where, "embedded-pool", 0, fmt, memory.ctypes.data, len(memory))
        try:
            assert parts.put([0x51, 0x52], [0, 1]) == [0, 0]  # there is memory to put into
            assert view.present([0x51, 0x52, 0x53]) == [True, True, False]
        finally:
            parts.close()
    finally:
        with caplog.at_level(logging.WARNING):
            shared.stop_embedded(run_directory)  # the worker's half ends first...
            view.close()  # ...then the scheduler's
    assert "is gone" not in caplog.text
    assert run_directory not in shared._masters and run_directory not in shared._segments


def test_the_master_outlives_the_thread_that_started_it_and_logs_in_the_run_directory(
    tmp_path,
) -> None:
    """Found by an audit: the kernel's parent-death signal follows the thread that started a
    child, and the master died with it; and each killed engine left its log in the system's
    temporary directory."""
    import glob
    import tempfile
    import threading

    problem = mooncake_problem()
    if problem is not None:
        pytest.skip(f"Mooncake Store cannot start here: {problem}")
    settings = SharedTierConfig(enabled=True, segment=16 << 20)
    run_directory = str(tmp_path)
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "raykv-mooncake-master-*")))
    started: list = []
    thread = threading.Thread(
        target=lambda: started.append(shared.endpoint(settings, run_directory))
    )
    thread.start()
    thread.join()
    try:
        (master,) = [shared._masters[run_directory]]
        time.sleep(0.5)  # a parent-death signal would have landed by now
        assert master.alive(), "the master died with the thread that started it"
        assert os.path.dirname(master.log_path) == run_directory
        assert (
            set(glob.glob(os.path.join(tempfile.gettempdir(), "raykv-mooncake-master-*"))) == before
        )
    finally:
        shared.stop_embedded(run_directory)
