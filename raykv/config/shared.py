"""The shared tier's section (``offload.shared``): the cluster-wide tier on Mooncake Store, where
its master is, how much DRAM this node gives the pool, and how chunks reach it."""

from __future__ import annotations

import logging
import os
import stat
from typing import Literal

from pydantic import Field, field_validator, model_validator

from raykv.config.base import ByteSize, ConfigError, _Strict

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
SECRET_ENV = "RAYKV_SHARED_SECRET"  # the cluster's secret, where no secret_file names one
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
MIN_SEGMENT = 16 * 2**20  # the least a Mooncake client gives the pool


def check_address(value: str) -> str:
    """``embedded`` or ``host:port`` (a port in 1..65535)."""
    if value == EMBEDDED:
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("neither 'embedded' nor host:port")
    return value


class SharedTierConfig(_Strict):
    """A tier every engine of the cluster reads and writes: each rank puts its part of a chunk
    into Mooncake Store under the chunk's namespaced key and reads what any engine put there.
    The pool's memory belongs to one store actor per node, not to an engine, so a replica's
    restart or scale-down loses nothing of it."""

    enabled: bool = Field(default=False, description="Use the shared tier (Mooncake Store).")
    master: str = Field(
        default=EMBEDDED,
        description="host:port of a running mooncake_master, or embedded: raykv starts one for "
        "the run on loopback on a free port and stops it at the end.",
    )
    segment: ByteSize = Field(
        default=2**30,
        gt=0,
        description="Bytes of DRAM this node gives the pool (mounted by the node's store actor).",
    )
    mount: bool = Field(
        default=True,
        description="raykv gives this node's segment (its store actor on Ray; a process of its "
        "own for an engine in one process). false: the pool's memory is given by others (a "
        "Mooncake store service the operator runs, or another raykv process); segment then only "
        "sizes this engine's index of the store.",
    )
    publish: Literal["through", "back"] = Field(
        default="through",
        description="When a chunk is put into the store: through, as the CPU tier stores it "
        "(every replica can load it from then on); back, as it leaves the CPU tier (fewer "
        "puts; what a replica still holds in DRAM is not shared, and goes with the replica). "
        "With a disk tier, back publishes what its demotions give up; without one (or while "
        "the disk takes none) it keeps offload.disk.reserve_fraction of the CPU tier free by "
        "publishing its coldest chunks ahead of need.",
    )
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="How the store moves bytes: tcp, or rdma where the NICs have it."
    )
    devices: str = Field(
        default="",
        description="RDMA devices (e.g. mlx5_0,mlx5_1); empty: found by Mooncake (rdma only).",
    )
    timeout_s: float = Field(
        default=5.0,
        gt=0,
        le=600,
        allow_inf_nan=False,
        description="Seconds an engine waits for the master to answer when it joins the store "
        "(a master nothing answers for is refused by name; Mooncake's own calls then fail "
        "after its timeouts, seconds each, and the tier pauses).",
    )
    retry_steps: int = Field(
        default=512,
        gt=0,
        description="Steps the tier stays out of use after its operations kept failing (the "
        "master unreachable), before it is tried again.",
    )

    secret_file: str | None = Field(
        default=None,
        description="A file holding the cluster's secret (at least 16 bytes, on every node of "
        "ranks, readable by raykv's processes only). Every part put into the store is sealed "
        "with it, and a part whose seal does not check is never loaded: only holders of the "
        "secret write parts that load. Needed with a master at host:port unless the "
        f"environment variable {SECRET_ENV} holds the secret in every raykv process; an "
        "embedded master makes a secret of its own for the run.",
    )

    @field_validator("master")
    @classmethod
    def _master(cls, value: str) -> str:
        return check_address(value)

    @field_validator("secret_file")
    @classmethod
    def _secret_file(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = absolute_path(value)
        read_secret(path)  # readable here, and a secret
        return path

    @model_validator(mode="after")
    def _segment_mountable(self) -> SharedTierConfig:
        if self.enabled and self.mount and self.segment < MIN_SEGMENT:
            raise ValueError(
                f"segment: {self.segment} bytes; Mooncake Store mounts segments of 16MiB or more"
            )
        return self

    @model_validator(mode="after")
    def _secret_given(self) -> SharedTierConfig:
        if (
            self.enabled
            and self.master != EMBEDDED
            and self.secret_file is None
            and not os.environ.get(SECRET_ENV)
        ):
            raise ValueError(
                "secret_file: a master at host:port needs the cluster's secret: name a file "
                f"holding it, or set {SECRET_ENV} in every raykv process"
            )
        return self


def absolute_path(value: str) -> str:
    """``value`` with ``~`` expanded, made absolute; ``ValueError`` where ``~user`` names
    nobody (expanduser leaves it as it is: a directory of that name in the working
    directory)."""
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise ValueError(f"{value!r}: no such user's home directory")
    return os.path.abspath(expanded)


def read_secret(path: str) -> bytes:
    """The secret in the file at ``path`` (trailing whitespace dropped); ``ValueError`` saying
    why it cannot be one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{path!r}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path!r} is not a regular file")
        if info.st_size > MAX_SECRET_BYTES:
            raise ValueError(f"{path!r} holds {info.st_size} bytes, a secret at most 4096")
        secret = os.read(fd, MAX_SECRET_BYTES).rstrip()
    finally:
        os.close(fd)
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path!r} holds {len(secret)} bytes, a secret at least 16")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the shared tier's secret file %s can be read by others (chmod 600)", path)
    return secret


def cluster_secret(shared: SharedTierConfig) -> bytes:
    """The cluster's secret as this process has it: ``offload.shared.secret_file``, else the
    environment variable; ``ConfigError`` naming the key where neither gives one."""
    if shared.secret_file is not None:
        try:
            return read_secret(shared.secret_file)
        except ValueError as exc:
            raise ConfigError(f"offload.shared.secret_file: {exc}") from None
    secret = os.environ.get(SECRET_ENV, "").encode().strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"offload.shared.secret_file: not set, and {SECRET_ENV} holds no secret of 16 bytes "
            "or more in this process"
        )
    return secret
