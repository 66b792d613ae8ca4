"""Cores of this machine claimed by one replica, so that replicas computing on the CPU (vLLM's
CPU platform binds its threads to cores) never share one.

Ray counts CPUs, it does not hand out cores: two replicas of one CPU each would both bind core 0.
A replica therefore claims cores itself: one abstract Unix socket per core (Linux), named for
the core and bound for as long as the replica's process lives. The kernel frees the name when
the process ends, however it ends: no file to clean up, no lease to expire.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

log = logging.getLogger(__name__)

PREFIX = "raykv-core"


class CoreClaim:
    """Cores this process holds (``cores``), until ``release`` or its end."""

    def __init__(self, cores: list[int], sockets: list[socket.socket], shared: bool) -> None:
        self.cores = cores
        self.shared = shared  # True: not enough free cores; these are shared with others
        self._sockets = sockets

    @classmethod
    def claim(cls, count: int, prefix: str = PREFIX) -> CoreClaim:
        """``count`` free cores of those this process may run on, lowest first. Where fewer
        are free, the lowest ones are taken anyway (shared, with a warning): serving slower
        beats not serving."""
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if not allowed:
            allowed = list(range(os.cpu_count() or 1))
        held: list[tuple[int, socket.socket]] = []
        for core in allowed:
            if len(held) == count:
                break
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(f"\0{prefix}-{os.getuid()}-{core}")
            except OSError:
                sock.close()
                continue
            held.append((core, sock))
        if len(held) == count:
            return cls([c for c, _ in held], [s for _, s in held], shared=False)
        mine = [c for c, _ in held]
        others = [c for c in allowed if c not in mine]
        cores = sorted(mine + others[: max(0, min(count, len(allowed)) - len(mine))])
        log.warning(
            "only %d of the %d cores this replica asks for are free on this machine; it "
            "shares cores %s with another replica",
            len(held),
            count,
            sorted(set(cores) - set(mine)),
        )
        return cls(cores, [s for _, s in held], shared=True)

    def bind_list(self, ranks: int = 1) -> str:
        """The cores as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` takes them: one comma list per
        rank, ranks separated by ``|``."""
        per = max(1, len(self.cores) // ranks)
        groups = [self.cores[i * per : (i + 1) * per] or self.cores[-1:] for i in range(ranks)]
        return "|".join(",".join(map(str, group)) for group in groups)

    def vllm_env(self, ranks: int = 1) -> dict[str, str]:
        """The environment that binds a vLLM engine of ``ranks`` ranks to these cores on its
        CPU platform: ``VLLM_CPU_OMP_THREADS_BIND`` and each rank's thread count."""
        return {
            "VLLM_CPU_OMP_THREADS_BIND": self.bind_list(ranks),
            "OMP_NUM_THREADS": str(max(1, len(self.cores) // ranks)),
        }

    def release(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
        self._sockets = []
