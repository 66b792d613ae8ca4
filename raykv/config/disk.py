"""The disk tier's section (``offload.disk``): where its files live, how much room they may
take, what it keeps, how it does its I/O."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Literal

from pydantic import Field, field_validator, model_validator

from raykv.config.base import _POLICY_RE, ByteSize, _Strict
from raykv.config.shared import absolute_path


def check_policy(value: str) -> str:
    """A policy spec the tiers can build: a registered name or ``module:Class`` that imports."""
    if not _POLICY_RE.match(value):
        raise ValueError("neither a policy name nor a module:Class import path")
    # checked now, not when the tier is built (in a Ray actor, after deployment). The import is
    # deferred: the policies package is plain Python, but config is the top layer.
    from raykv.offload.policies import resolve_policy

    try:
        resolve_policy(value)
    except ValueError:
        raise
    except Exception as exc:  # a custom policy's module failed while importing
        raise ValueError(f"cannot load policy {value!r}: {type(exc).__name__}: {exc}") from None
    return value


class DiskTierConfig(_Strict):
    """The disk tier under the CPU tier: chunks the CPU tier evicts are written to files (per
    rank) and read back into a CPU slot when a request needs them; a later run on the same path
    with the same model and layout finds them (warm restart)."""

    enabled: bool = Field(default=False, description="Use a disk tier under the CPU tier.")
    path: str | None = Field(
        default=None,
        description="A directory for the tier's files (created; on every node of ranks): each "
        "run keeps them under <path>/<namespace>/rank-<r>/, the namespace naming the model, "
        "dtype, KV layout, block and chunk sizes and TP size.",
    )
    capacity: ByteSize = Field(
        default=16 * 2**30,
        gt=0,
        description="Bytes the tier's files may take on a node, all its ranks together (e.g. "
        "64GiB); at most the free space there plus what this namespace's files already take.",
    )
    policy: str = Field(
        default="lru",
        description="Eviction policy of the disk tier: a registered name (lru, arc, recall) or "
        "module:Class.",
    )
    store_threshold: int = Field(
        default=0,
        ge=0,
        description="Write to disk only chunks asked for this often, in any tier (>= 2 enables; "
        "0 writes every chunk the CPU tier gives up): spares the drive one-shot chunks, but a "
        "chunk whose second use comes after the CPU tier gave it up is then lost (on the "
        "shared trace with a 512 MiB CPU tier, 2 kept 144 tokens of disk hits where 0 kept "
        "10,672).",
    )
    io_threads: int = Field(default=4, gt=0, description="I/O threads of each rank.")
    direct_io: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="O_DIRECT (the page cache bypassed): on, off, or auto (where the file "
        "system allows it); the report says which ran.",
    )
    fsync: bool = Field(
        default=False,
        description="Each file reaches the device before it counts as stored (a power loss "
        "keeps every stored chunk; slower writes). Without it a machine crash may lose recent "
        "chunks, never serve a torn one.",
    )
    reserve_fraction: float = Field(
        default=0.125,
        gt=0,
        le=0.5,
        description="The share of the CPU tier kept free by demoting its coldest chunks to "
        "disk ahead of need, so that stores find room without waiting for the disk (at "
        "least what two steps can store, at most half the tier). Also the share the shared "
        "tier's write-back (offload.shared.publish: back) keeps free by publishing, without a "
        "disk tier or while the disk takes no demotions.",
    )
    spill_on_stop_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="At a graceful stop (the end of raykv run or raykv generate, SIGTERM or a "
        "rolling update under raykv serve, a client's shutdown) the CPU tier's ready chunks "
        "are written to the disk tier, for at most this many seconds, so the engine that "
        "comes up on this path starts warm; 0: nothing is written at a stop.",
    )
    retry_full_steps: int = Field(
        default=512,
        gt=0,
        description="Steps the tier stops admitting after a write found the disk full, before "
        "it tries again.",
    )

    @field_validator("policy")
    @classmethod
    def _policy_spec(cls, value: str) -> str:
        return check_policy(value)

    @field_validator("direct_io", mode="before")
    @classmethod
    def _yaml_switch(cls, value: object) -> object:
        # YAML 1.1 reads a bare on/off as a boolean: take it as the word it was
        if isinstance(value, bool):
            return "on" if value else "off"
        return value

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        # made absolute where the config is read: a rank (another working directory, another
        # process) reads the same directory; a ~user that names nobody is refused
        return None if value is None else absolute_path(value)

    @model_validator(mode="after")
    def _where(self) -> DiskTierConfig:
        if self.enabled and not self.path:
            raise ValueError("enabled needs path (a directory for the tier's files)")
        if self.enabled and self.path:
            problem = writable_problem(self.path)
            if problem:
                raise ValueError(f"path {self.path!r}: {problem}")
        return self


def nearest_existing(path: str) -> str:
    """``path`` or its closest ancestor that exists (a link that leads nowhere exists: it is
    what stands in the way)."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def writable_problem(path: str) -> str | None:
    """Why files cannot be made under ``path`` (None: they can; the directories it lacks are
    created when a rank starts). Tried for real, with a directory made and removed where the
    path begins to be missing: permission bits say nothing for root, nor on /proc."""
    existing = nearest_existing(path)
    if os.path.islink(existing) and not os.path.exists(existing):
        return f"{existing!r} is a link to {os.readlink(existing)!r}, which does not exist"
    if not os.path.isdir(existing):
        return f"{existing!r} is not a directory"
    try:
        probe = tempfile.mkdtemp(prefix=".raykv-probe-", dir=existing)
    except OSError as exc:
        return f"cannot make a directory in {existing!r} ({exc.strerror})"
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return None


def free_bytes(path: str) -> int:
    """Free bytes on the file system that holds (or will hold) ``path``."""
    return shutil.disk_usage(nearest_existing(path)).free
