"""What listens beyond loopback among the processes this test session started (and itself):
Ray's, its workers and actors, what they started (the store's master and segments), and the
Mooncake clients in this process."""

from __future__ import annotations

import ipaddress

import psutil


def loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is loopback too
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def exposed_listeners() -> dict[str, str]:
    """``address:port`` -> the command line of its process, for every listening TCP socket of
    this process and its descendants not bound to loopback (not a name match, which a
    checkout's path, "raykv", would pass for everything)."""
    me = psutil.Process()
    ours = {me.pid} | {child.pid for child in me.children(recursive=True)}
    exposed: dict[str, str] = {}
    for c in psutil.net_connections(kind="tcp"):
        if c.status != psutil.CONN_LISTEN or c.pid not in ours or loopback(c.laddr.ip):
            continue
        try:
            name = " ".join(psutil.Process(c.pid).cmdline())
        except psutil.Error:
            continue
        exposed[f"{c.laddr.ip}:{c.laddr.port}"] = name[:80]
    return exposed


def listening_pids() -> set[int]:
    """The processes (this one and its descendants) with a listening TCP socket."""
    me = psutil.Process()
    ours = {me.pid} | {child.pid for child in me.children(recursive=True)}
    return {
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.pid in ours
    }
