"""Failed loads inside vLLM: the request recomputes, and the bad chunks leave their tier.

vLLM 0.32's ``OffloadingConnector`` asserts that every transfer succeeded and never reports a
failed load to the scheduler, although the scheduler knows how to recompute one
(``KVConnectorTransferResults.failed_recving`` with ``kv_load_failure_policy: recompute``;
``fail``, vLLM's default, ends the request with an error instead). So raykv's worker reports
every job done, remembers which loads failed, and :func:`report_failed_loads` makes the
connector's ``get_transfer_results`` name those loads' requests as failed (a change to that one
method, made when this module is imported, that does nothing for other specs).

The manager (in the scheduler process) learns which chunks were bad from :class:`BadKeys`: each
worker appends their keys to a small file of its own, which the manager reads at the end of
each scheduler step and before it completes a job, so a bad chunk is looked up as a miss from
the next step on (one still being read or written leaves as soon as it is not).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from raykv.vllm.run_directory import LOCK, release

log = logging.getLogger(__name__)

_RECORD = 20  # the tiers it leaves, 18 hex digits (a 72-bit key) and a newline
# which tiers a bad key leaves: every one (its source was bad), the CPU tier only (a promotion
# that failed left its slot half written), the disk tier only (its file could not be written),
# the shared tier only (its parts could not be put), the CPU tier with its slot held a while (a
# read from the store that Mooncake gave up on: its bytes may still land there)
EVERY_TIER, CPU_TIER, DISK_TIER, SHARED_TIER, HELD_SLOT = "a", "c", "d", "s", "h"


class BadKeys:
    """Keys of chunks a worker found bad, appended to ``directory/bad-keys.rank<r>`` by each
    rank and read, each file from where it was last read, by the manager."""

    def __init__(self, directory: str, ranks: int) -> None:
        self.directory = directory
        self.paths = [os.path.join(directory, f"bad-keys.rank{rank}") for rank in range(ranks)]
        self._offsets = [0] * ranks
        self._lock = threading.Lock()

    def append(self, rank: int, keys: list[int], tiers: str = EVERY_TIER) -> None:
        """Record ``keys`` for the manager (one ``write`` of whole records: never torn)."""
        if keys:
            data = "".join(f"{tiers}{key:018x}\n" for key in keys).encode()
            try:
                fd = os.open(self.paths[rank], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            except FileNotFoundError:  # the manager has shut down: nobody is left to tell
                return
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def remove(self) -> None:
        """Delete the files and their directory (the engine is shutting down)."""
        for path in [*self.paths, os.path.join(self.directory, LOCK)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        release(self.directory)
        with contextlib.suppress(OSError):
            os.rmdir(self.directory)

    def take(self) -> list[tuple[str, int]]:
        """``(tiers, key)`` appended since the last call, by any rank."""
        found: list[tuple[str, int]] = []
        with self._lock:
            for number, path in enumerate(self.paths):
                try:
                    size = os.path.getsize(path)
                except FileNotFoundError:
                    continue
                start = self._offsets[number]
                end = start + (size - start) // _RECORD * _RECORD
                if end <= start:
                    continue
                with open(path, "rb") as handle:
                    handle.seek(start)
                    data = handle.read(end - start)
                self._offsets[number] = end
                found.extend((line[:1].decode(), int(line[1:], 16)) for line in data.split())
        return found


_original = OffloadingConnector.get_transfer_results


def _get_transfer_results(self: OffloadingConnector, finished_req_ids: set[str]):
    worker_side = getattr(self, "connector_worker", None)
    spec = getattr(worker_side, "spec", None)
    take = getattr(spec, "take_failed_loads", None)
    if take is None:  # another spec's connector, or the scheduler's
        return _original(self, finished_req_ids)
    requests = dict(worker_side._load_jobs)  # job -> request, before the jobs are reported
    results: KVConnectorTransferResults = _original(self, finished_req_ids)
    for job_id in take():
        request = requests.get(job_id)
        if request is not None:
            log.warning("request %s: a load from raykv's tiers failed; it recomputes", request)
            results.failed_recving.add(request)
            results.finished_recving.add(request)
    return results


def report_failed_loads() -> None:
    """Make vLLM's offloading connector report the loads raykv's worker failed."""
    OffloadingConnector.get_transfer_results = _get_transfer_results  # type: ignore[method-assign]
