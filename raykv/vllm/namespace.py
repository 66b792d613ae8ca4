"""The namespace of raykv's persistent tiers inside vLLM: everything a chunk's bytes depend on
besides its key (see ``engine/tier_namespace.py`` for raykv's own engine). Two vLLM engines that
agree on all of it share chunks (a warm restart, another replica); anything else never reads
them. docs/reliability.md says what is in it and why.

Part of it is the offloading configuration both halves of the spec are given (the KV layout, the
block and chunk sizes, the parallel layout, the device). The rest only a process of the engine
knows, and the namespace is agreed on through the engine's run directory (``NamespaceBoard``):

- what runs, which only a worker knows: vLLM's model configuration after every override and a
  fingerprint of the weights it holds (``weights.py``), each rank its own shard's, posted for
  an *epoch*;
- the seed of vLLM's block hashes, which only the scheduler's process knows, once vLLM has set
  it (after the manager is built): the manager reads it when it first needs the namespace.

The manager composes the namespace of an epoch once every rank has posted for it and publishes
it; each worker then builds its disk and shared engines under it and says so; from then on the
manager lets lookups reach those tiers. A reset of the connector (``reset_prefix_cache(
reset_connector=True)``, what follows a weight update) starts the next epoch: the workers post
what they hold now, and the engine moves to the namespace of its new weights (replicas that load
the same new weights share again), leaving the old namespace's files and parts to the engines
still on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from raykv.transfer.disk_files import (
    FORMAT_VERSION,
    NAMESPACE_BYTES,
    ChunkIdentity,
    private_directory,
)

log = logging.getLogger(__name__)

EPOCH_FILE = "namespace-epoch"
# how long lookups of chunks the CPU tier lacks are asked again (vLLM's RETRY) while the
# workers agree on a namespace (a step or two at start and after a reset), before they miss
AGREE_WAIT_S = 5.0


def base_parts(config: OffloadingConfig, device: str) -> dict[str, Any]:
    """What the offloading configuration says of the bytes (both halves have it)."""
    parallel = config.parallel
    return {
        "format": FORMAT_VERSION,
        "engine": "vllm",
        "model_name": os.path.basename(os.path.normpath(config.model.name)),
        "kv_cache_layout": config.kv_cache_layout,
        "tokens_per_block": [group.tokens_per_block for group in config.groups],
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "tensor_parallel_size": parallel.tp_size,
        "world_size": parallel.world_size,
        "pipeline_parallel_size": parallel.pp_size,
        "context_parallel": [parallel.pcp_size, parallel.dcp_size],
        "device": device,
    }


def compose(base: dict[str, Any], posts: list[dict[str, Any]], hash_seed: str) -> dict[str, Any]:
    """The namespace from ``base``, every rank's post (rank order) and the block hashes' seed;
    ValueError where the ranks disagree on the model's configuration."""
    configurations = {json.dumps(post["model"], sort_keys=True) for post in posts}
    if len(configurations) != 1:
        raise ValueError("the workers run models of different configurations")
    return {
        **base,
        "model": posts[0]["model"],
        "weights": [post["weights"] for post in posts],
        # engines whose block hashes start from other seeds never name the same prefix
        "hash_seed": hashlib.sha256(hash_seed.encode()).hexdigest()[:16],
    }


def digest(parts: dict[str, Any]) -> bytes:
    return hashlib.blake2b(
        json.dumps(parts, sort_keys=True).encode(), digest_size=NAMESPACE_BYTES
    ).digest()


def directory_name(parts: dict[str, Any]) -> str:
    """A readable label and the start of the digest."""
    label = re.sub(r"[^A-Za-z0-9._-]+", "-", str(parts.get("model_name") or "model"))[:48]
    dtype = parts.get("model", {}).get("dtype", "").replace("torch.", "")
    tp = parts["tensor_parallel_size"]
    return f"vllm-{label}-{dtype}-tp{tp}-{digest(parts)[:10].hex()}"


def identity(parts: dict[str, Any], rank: int) -> ChunkIdentity:
    return ChunkIdentity(digest(parts), rank, parts["world_size"])


def describe(root: str, parts: dict[str, Any]) -> None:
    """Write ``namespace.json`` in the namespace's directory ``root`` (made this user's only
    where missing): what its name stands for, for whoever looks."""
    private_directory(root)
    fd, tmp = tempfile.mkstemp(prefix=".namespace.", suffix=".tmp", dir=root)
    with os.fdopen(fd, "w") as handle:
        json.dump(parts, handle, indent=2, sort_keys=True)
    os.replace(tmp, os.path.join(root, "namespace.json"))


class NamespaceBoard:
    """The files in the engine's run directory through which its processes agree on the
    namespace of each epoch (the module's docstring): ``namespace-epoch`` (the manager's current
    epoch), ``model-<epoch>.rank<r>`` (what rank r runs), ``namespace-<epoch>`` (the namespace
    the manager composed) and ``ready-<epoch>.rank<r>`` (rank r's engines are built under it).
    Each is written whole under a temporary name and renamed into place."""

    def __init__(self, directory: str, ranks: int) -> None:
        self.directory = directory
        self.ranks = ranks
        self._epoch_seen: tuple[int, int] | None = None  # the epoch file's (inode, mtime)
        self._epoch = 0

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _write(self, name: str, value: Any) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(value, handle, sort_keys=True)
            os.replace(tmp, self._path(name))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _read(self, name: str) -> Any:
        try:
            with open(self._path(name)) as handle:
                return json.load(handle)
        except (OSError, ValueError):  # not there (yet), or unreadable: not posted
            return None

    # ---- the epoch ---------------------------------------------------------------------------

    def epoch(self) -> int:
        """The manager's current epoch (0 before any reset); a stat, and a read where the file
        changed."""
        try:
            st = os.stat(self._path(EPOCH_FILE))
        except FileNotFoundError:
            return self._epoch
        seen = (st.st_ino, st.st_mtime_ns)
        if seen != self._epoch_seen:
            value = self._read(EPOCH_FILE)
            if isinstance(value, int):
                self._epoch, self._epoch_seen = value, seen
        return self._epoch

    def start_epoch(self, epoch: int) -> None:
        """The manager moves to ``epoch`` (a reset): the workers post what they run for it."""
        self._write(EPOCH_FILE, epoch)
        self._epoch = epoch

    # ---- the workers' side -------------------------------------------------------------------

    def post(self, epoch: int, rank: int, model: dict[str, Any], weights: str) -> None:
        """What ``rank`` runs in ``epoch``."""
        self._write(f"model-{epoch}.rank{rank}", {"model": model, "weights": weights})

    def namespace(self, epoch: int) -> dict[str, Any] | None:
        """The namespace the manager composed for ``epoch`` (None: not yet)."""
        return self._read(f"namespace-{epoch}")

    def ready(self, epoch: int, rank: int, disk_root: str | None) -> None:
        """``rank``'s engines are built under ``epoch``'s namespace; ``disk_root``: the
        directory its disk engine holds (another engine on the node may hold the first)."""
        self._write(f"ready-{epoch}.rank{rank}", {"disk_root": disk_root})

    # ---- the manager's side ------------------------------------------------------------------

    def posts(self, epoch: int) -> list[dict[str, Any]] | None:
        """Every rank's post for ``epoch`` (None until all have posted)."""
        found = [self._read(f"model-{epoch}.rank{rank}") for rank in range(self.ranks)]
        return None if any(post is None for post in found) else found

    def publish(self, epoch: int, parts: dict[str, Any]) -> None:
        self._write(f"namespace-{epoch}", parts)

    def all_ready(self, epoch: int) -> list[str | None] | None:
        """Each rank's disk directory once every rank is ready under ``epoch`` (None: not
        yet)."""
        found = [self._read(f"ready-{epoch}.rank{rank}") for rank in range(self.ranks)]
        if any(not isinstance(post, dict) for post in found):
            return None
        return [post.get("disk_root") for post in found]

    def clear_before(self, epoch: int) -> None:
        """Remove the files of the epochs before ``epoch``."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            match = re.match(r"^(?:model|namespace|ready)-(\d+)", name)
            if match and int(match.group(1)) < epoch:
                with contextlib.suppress(OSError):
                    os.unlink(self._path(name))

    def remove(self) -> None:
        """Every file of the board (the engine shuts down)."""
        self.clear_before(1 << 62)
        with contextlib.suppress(OSError):
            os.unlink(self._path(EPOCH_FILE))


class NamespaceAgreement:
    """The manager's side of the namespace: composes each epoch's from the workers' posts and
    the block hashes' seed, and says when every worker's engines are built under it.

    Args:
        board: the engine's ``NamespaceBoard``.
        base: what the offloading configuration says of the bytes (``base_parts``).
        open_tiers: the manager's tiers under a namespace (the spec's: the disk files every
            rank holds in the directory it says it holds, the store's index pointed at it): the
            keys found on disk.
        wait_s: how long lookups ask again while a namespace is being agreed on.
        clock: seconds, monotonic (a test's clock).
    """

    def __init__(
        self,
        board: NamespaceBoard,
        base: dict[str, Any],
        open_tiers: Callable[[dict[str, Any], Any, list[str | None]], list[int]],
        wait_s: float = AGREE_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.board = board
        self.base = base
        self.open_tiers = open_tiers
        self.wait_s = wait_s
        self.clock = clock
        self.epoch = 0
        self.parts: dict[str, Any] | None = None
        self.disk_roots: list[str | None] = []  # each rank's, once all are ready
        # when lookups started asking again (the first that needed the namespace: an engine
        # may sit idle for long before its first request, and none steps it meanwhile)
        self._since: float | None = None
        self._said = False

    def poll(self) -> dict[str, Any] | None:
        """The epoch's namespace once every worker has built its engines under it (None
        meanwhile); composed and published here once every worker has posted."""
        board = self.board
        if self.parts is None:
            posts = board.posts(self.epoch)
            if posts is None:
                return None
            from vllm.v1.core.kv_cache_utils import get_none_hash_seed

            try:
                parts = compose(self.base, posts, get_none_hash_seed())
            except ValueError as exc:
                if not self._said:
                    self._said = True
                    log.error("raykv: the disk and shared tiers stay out of use: %s", exc)
                return None
            board.publish(self.epoch, parts)
            self.parts = parts
        roots = board.all_ready(self.epoch)
        if roots is None:
            return None
        self.disk_roots = roots
        return self.parts

    def waiting(self) -> bool:
        """Whether lookups still ask again for the namespace (within ``wait_s`` of the first
        that did)."""
        now = self.clock()
        if self._since is None:
            self._since = now
        return now - self._since < self.wait_s

    def next_epoch(self) -> None:
        """A reset: the workers post what they run now, and a namespace is agreed on again."""
        self.epoch += 1
        self.parts = None
        self._since = None
        self._said = False
        self.board.start_epoch(self.epoch)
        self.board.clear_before(self.epoch)
