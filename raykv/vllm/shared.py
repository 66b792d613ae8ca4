"""The shared tier (Mooncake Store) inside vLLM: where this engine's processes join the store,
the memory it gives the store's pool, and the scheduler's index of what the store holds.

``raykv.shared.master`` is ``host:port`` of a running ``mooncake_master`` (the deployment: every
replica of the model joins the same master, and each loads what any other published), or
``embedded``: a master for this engine alone, started by the first of its processes to need it
(vLLM builds its workers before its scheduler, each in a process of its own where it runs more
than one) and found by the others through the engine's private run directory, which also holds
the master's address and the secret that seals every part. ``mount: true`` gives ``segment``
bytes of DRAM to the pool for as long as the engine runs (in process: vLLM's engine processes
are daemons, which may not start processes of their own): the embedded master's own process
gives them, beside the master (a client lets its segment go only from a live master: from a
dead one it retries for about 15 s with Python's lock held, and the process that started the
master stops it when its half of the engine shuts down, before the other processes' halves);
with a master at ``host:port``, the scheduler's process. ``mount: false`` leaves the pool's
memory to others (a store service, another replica).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import threading
import time

from raykv.config import ConfigError
from raykv.config.sections import OffloadConfig
from raykv.config.shared import EMBEDDED, SharedTierConfig, cluster_secret
from raykv.transfer.seal import new_secret
from raykv.transfer.shared_master import EmbeddedMaster
from raykv.transfer.shared_store import (
    SegmentHolder,
    SharedStoreError,
    SharedUnavailable,
    StoreEndpoint,
    StoreIndex,
    close_idle,
    reachable,
)

log = logging.getLogger(__name__)

ENDPOINT_FILE = "shared-endpoint"  # the embedded master's address and the run's secret
CLAIM_FILE = "shared-master.claim"  # created by the one process that starts the master
START_WAIT_S = 60.0  # how long another process waits for that one to say where the master is

# embedded masters this process started, by run directory, with how many of this process's
# halves of the engine (its manager, its worker) use them: stopped when the last one closes
# (a client that leaves a dead master, the segment's above all, retries for many seconds)
_masters: dict[str, EmbeddedMaster] = {}
_segments: dict[str, SegmentHolder] = {}  # the memory each of those masters' pool has here
_users: dict[str, int] = {}
_masters_lock = threading.Lock()


def shared_settings(settings: OffloadConfig) -> SharedTierConfig | None:
    """The shared tier's section where it is enabled (None: no shared tier)."""
    return settings.shared if settings.shared.enabled else None


def endpoint(shared: SharedTierConfig, run_directory: str) -> StoreEndpoint:
    """Where this process joins the store: the configured master with the cluster's secret, or
    this engine's embedded master (started here if no other process of the engine has).
    ``SharedUnavailable`` naming ``raykv.shared.master`` where it cannot be had."""
    if shared.master != EMBEDDED:
        try:
            secret = cluster_secret(shared)
        except ConfigError as exc:
            raise ConfigError(inside_vllm(str(exc))) from None
        return StoreEndpoint.of(shared, shared.master, secret)
    if not shared.mount:
        raise ConfigError(
            "raykv.shared.mount: false with an embedded master: nothing could give its pool "
            "memory (name a master at host:port that others give memory to, or mount)"
        )
    try:
        address, secret = _embedded(run_directory, shared)
    except (SharedStoreError, OSError, ValueError) as exc:
        raise SharedUnavailable(
            f"raykv.shared.master: the engine's embedded master: {exc}"
        ) from None
    with _masters_lock:
        if run_directory in _masters:
            _users[run_directory] = _users.get(run_directory, 0) + 1
    return StoreEndpoint.of(shared, address, secret)


def inside_vllm(message: str) -> str:
    """raykv's message about one of its ``offload.shared`` keys, naming it as vLLM's config
    has it (``raykv.shared.<key>``)."""
    return message.replace("offload.shared.", "raykv.shared.")


def namespace_of(base: str, where: StoreEndpoint) -> str:
    """The store's namespace for chunks under ``base``, sealed with ``where``'s secret: engines
    with other secrets never see each other's parts (rather than finding them, failing their
    seals and removing them from the store, which would cost every other replica its hits)."""
    mark = hashlib.blake2b(where.secret, key=b"raykv-secret-mark", digest_size=6).hexdigest()
    return f"{base}-{mark}"


def _embedded(run_directory: str, shared: SharedTierConfig) -> tuple[str, bytes]:
    path = os.path.join(run_directory, ENDPOINT_FILE)
    claim = os.path.join(run_directory, CLAIM_FILE)
    try:
        os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return _wait_for(path)
    # its log in the run directory: removed with it, also where the engine was killed (each
    # SIGINT of vllm serve left one in the temporary directory)
    master = EmbeddedMaster(log_dir=run_directory)
    try:
        address = master.start()
        # the pool's memory, given from here: it goes before the master, in stop_embedded
        segment = SegmentHolder(StoreEndpoint.of(shared, address, b""), shared.segment)
    except BaseException as exc:  # whatever failed: no master left behind, nobody left waiting
        master.stop()
        _publish(path, f"failed {exc}")  # the others say why at once, not after a wait
        raise
    with _masters_lock:
        _masters[run_directory] = master
        _segments[run_directory] = segment
    secret = new_secret()
    _publish(path, f"{address} {secret.hex()} {master.pid}")
    log.info("raykv: an embedded Mooncake master for this engine at %s", address)
    return address, secret


def _publish(path: str, line: str) -> None:
    partial = f"{path}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(line + "\n")
    os.replace(partial, path)  # whole or absent: a reader never sees half of it


def _wait_for(path: str) -> tuple[str, bytes]:
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            with open(path) as handle:
                first, _, rest = handle.read().strip().partition(" ")
            if first == "failed":
                raise SharedStoreError(rest)
            return first, bytes.fromhex(rest.split()[0])
        time.sleep(0.05)
    raise SharedStoreError(
        f"the engine's embedded master was not started within {START_WAIT_S:g} s"
    )


def stop_embedded(run_directory: str) -> None:
    """One user of the embedded master this process started for the engine (if it did) is
    done with it: the last one stops it."""
    with _masters_lock:
        if run_directory not in _masters:
            return  # another process's, or none
        left = _users.get(run_directory, 0) - 1
        if left > 0:
            _users[run_directory] = left
            return
        _users.pop(run_directory, None)
        master = _masters.pop(run_directory)
        segment = _segments.pop(run_directory, None)
    if segment is not None:
        _let_go(segment, master.address)
    close_idle(master.address)
    master.stop()
    for name in (ENDPOINT_FILE, CLAIM_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(run_directory, name))


def kill_embedded(run_directory: str) -> bool:
    """Kill the engine's embedded master at once, whichever of its processes started it
    (``kill-shared-master``: nothing starts it again inside vLLM, so the shared tier stays out
    of use, each request recomputing what it would have loaded); False where it has none."""
    with _masters_lock:
        mine = _masters.get(run_directory)
    if mine is not None:
        mine.kill()
        return True
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(os.path.join(run_directory, ENDPOINT_FILE)) as handle:
            fields = handle.read().split()
        pid = int(fields[2])
        # the pid the file names, only while it is still a Mooncake master (not one reused)
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"mooncake_master" not in handle.read():
                return False
        os.kill(pid, signal.SIGKILL)
        return True
    return False


class StoreView:
    """The scheduler's side of the store: its index of what every rank's parts are there for
    (under the namespace of ``use_namespace``), and, with a master at ``host:port``, the segment
    this engine gives the pool (``mount``; an embedded master's process gives its own). Built
    at start, so that a store that cannot be had is said then: the index joins the store under
    a provisional namespace until the workers agree on the real one."""

    def __init__(self, shared: SharedTierConfig, where: StoreEndpoint, ranks: int) -> None:
        self.segment: SegmentHolder | None = None
        self.where = where
        self._master = where.master
        self.index: StoreIndex | None = None
        try:
            if shared.mount and shared.master != EMBEDDED:  # an embedded one's gives its own
                self.segment = SegmentHolder(where, shared.segment)
            self.index = StoreIndex(where, "raykv-provisional", ranks)
        except SharedStoreError as exc:
            self.close()
            raise SharedUnavailable(f"raykv.shared.master: {exc}") from None

    def use_namespace(self, namespace: str) -> None:
        """Ask the store about chunks under ``namespace`` from now on."""
        if self.index is not None:
            self.index.namespace = namespace

    def present(self, keys: list[int]) -> list[bool]:
        """Whether every rank's part of each chunk is in the store (``SharedStoreError`` when
        the store cannot say)."""
        if self.index is None:
            raise SharedStoreError("the store's index is not joined")
        return self.index.present(keys)

    def close(self) -> None:
        index, self.index = self.index, None
        if index is not None:
            index.close()
        segment, self.segment = self.segment, None
        if segment is not None:
            _let_go(segment, self._master)


def _let_go(segment: SegmentHolder, master: str) -> None:
    """Give the pool's memory back. Against a master already gone (it died), Mooncake's client
    retries the unmount for about 15 s with the interpreter's lock held, whenever it is let go
    (here, or at the process's exit): said, as nothing shortens it."""
    if reachable(master, 0.2):
        segment.close()
    else:
        log.warning(
            "raykv: the store's master at %s is gone; letting its segment go takes Mooncake "
            "about 15 s",
            master,
        )
