"""Mooncake's listeners on the address raykv names, not on every interface.

A Mooncake Store client (``mooncake-transfer-engine`` 0.3.x) opens its transfer engine's
listeners itself: the P2P handshake server and the TCP transport's acceptor bind the wildcard
address (``0.0.0.0`` and ``[::]``) whatever ``local_hostname`` says, and no setting of the
library changes that (upstream issue kvcache-ai/Mooncake#1938). A node whose raykv runs alone
would offer them to its whole network.

So raykv points the ``bind`` that Mooncake's own shared objects call at a function of its own:
the entries for ``bind`` in those objects' global offset tables (found from their ELF
relocations, in this process only) are replaced with a wrapper that turns a wildcard address
into the one given (loopback for a run on one node, the node's address where raykv is told to
use it) and passes every other bind through unchanged. Nothing outside Mooncake's objects is
touched: Python's sockets, Ray's, torch's still call libc's ``bind`` directly. A Mooncake whose
objects carry no such entry is left as it is, said once in the log; the listener tests then
fail.

The wrapper is a ctypes callback: Mooncake binds from the thread that calls ``setup`` (which
holds the interpreter's lock), at setup only, so the callback's cost and its need for the
lock never matter.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import mmap
import os
import socket
import struct
import threading

log = logging.getLogger(__name__)

_AF_INET, _AF_INET6 = socket.AF_INET, socket.AF_INET6
# the relocation types that fill a function's GOT entry, by machine (EM_X86_64, EM_AARCH64)
_SLOT_TYPES = {62: (7, 6), 183: (1026, 1025)}  # (JUMP_SLOT, GLOB_DAT)
_BIND = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, use_errno=True
)

_lock = threading.Lock()
_target: list[str] = []  # the address wildcard binds get (one, set by bind_mooncake_to)
_patched: set[str] = set()  # the shared objects whose bind was redirected
_hook = None  # the callback (kept alive for as long as the process)
_libc = ctypes.CDLL(None, use_errno=True)
_real_bind = _BIND(ctypes.cast(_libc.bind, ctypes.c_void_p).value)
_getsockopt = _libc.getsockopt


def _v6only(fd: int) -> bool:
    value, size = ctypes.c_int(0), ctypes.c_uint32(4)
    rc = _getsockopt(
        fd, socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, ctypes.byref(value), ctypes.byref(size)
    )
    return rc == 0 and value.value != 0


def _bind(fd: int, address: int, length: int) -> int:
    """``bind`` as Mooncake calls it, with a wildcard address made the target."""
    try:
        if _target and address and length >= 2:
            family = ctypes.c_ushort.from_address(address).value
            raw = ctypes.string_at(address, length)
            target = ipaddress.ip_address(_target[0])
            if family == _AF_INET and length >= 16 and raw[4:8] == bytes(4):
                if target.version == 4:
                    fixed = raw[:4] + target.packed + raw[8:]
                    return _call(fd, fixed)
            elif family == _AF_INET6 and length >= 28 and raw[8:24] == bytes(16):
                if target.version == 6:
                    packed = target.packed
                elif _v6only(fd):  # an IPv6-only socket cannot take an IPv4 address
                    packed = ipaddress.IPv6Address("::1").packed if target.is_loopback else None
                else:  # dual stack: the IPv4 address, mapped (peers connect over IPv4)
                    packed = ipaddress.IPv6Address(f"::ffff:{target}").packed
                if packed is not None:
                    return _call(fd, raw[:8] + packed + raw[24:])
    except Exception as exc:  # never fail a bind for the wrapper's sake: pass it through
        log.debug("bind wrapper: %s", exc)
    rc = _real_bind(fd, address, length)
    ctypes.set_errno(ctypes.get_errno())
    return rc


def _call(fd: int, raw: bytes) -> int:
    buffer = ctypes.create_string_buffer(raw, len(raw))
    rc = _real_bind(fd, ctypes.addressof(buffer), len(raw))
    ctypes.set_errno(ctypes.get_errno())
    return rc


# ---------------------------------------------------------------- the objects and their GOTs


class _PhdrInfo(ctypes.Structure):
    _fields_ = [
        ("addr", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("phdr", ctypes.c_void_p),
        ("phnum", ctypes.c_uint16),
    ]


_ITERATE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p
)


def _loaded_objects() -> list[tuple[str, int]]:
    """(path, load address) of every shared object in this process."""
    found: list[tuple[str, int]] = []

    def visit(info: ctypes.POINTER(_PhdrInfo), size: int, data: int) -> int:  # type: ignore[valid-type]
        name = info.contents.name
        if name:
            found.append((name.decode(errors="replace"), info.contents.addr))
        return 0

    _libc.dl_iterate_phdr(_ITERATE(visit), None)
    return found


def _bind_slots(path: str) -> list[int]:
    """The offsets (from the load address) of the GOT entries through which the shared object
    at ``path`` calls ``bind``: its relocations of that symbol, read from the file."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as elf:
        if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:  # 64-bit little-endian only
            return []
        machine = struct.unpack_from("<H", elf, 18)[0]
        if machine not in _SLOT_TYPES:
            return []
        (shoff,) = struct.unpack_from("<Q", elf, 40)
        shentsize, shnum = struct.unpack_from("<HH", elf, 58)
        sections = [
            struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)
        ]
        slots: list[int] = []
        for _, kind, _, _, offset, size, link, _, _, entsize in sections:
            if kind != 4 or not entsize:  # SHT_RELA
                continue
            symtab = sections[link]
            strtab = sections[symtab[6]]
            for at in range(offset, offset + size, entsize):
                r_offset, r_info = struct.unpack_from("<QQ", elf, at)
                if (r_info & 0xFFFFFFFF) not in _SLOT_TYPES[machine]:
                    continue
                sym = symtab[4] + (r_info >> 32) * symtab[9]
                name_at = strtab[4] + struct.unpack_from("<I", elf, sym)[0]
                end = elf.find(b"\0", name_at)
                if elf[name_at:end] == b"bind":
                    slots.append(r_offset)
        return slots


def _protection(address: int) -> int:
    """The page protection of ``address`` in this process (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return (
                    (mmap.PROT_READ if perms[0] == "r" else 0)
                    | (mmap.PROT_WRITE if perms[1] == "w" else 0)
                    | (mmap.PROT_EXEC if perms[2] == "x" else 0)
                )
    raise OSError(f"no mapping holds {address:#x}")


def _write_pointer(address: int, value: int) -> None:
    page = mmap.PAGESIZE
    start = address & ~(page - 1)
    before = _protection(address)
    mprotect = _libc.mprotect
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    writable = before & mmap.PROT_WRITE
    if not writable and mprotect(start, page, before | mmap.PROT_WRITE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect")
    try:
        ctypes.c_void_p.from_address(address).value = value
    finally:
        if not writable:
            mprotect(start, page, before)


def bind_mooncake_to(host: str) -> int:
    """Have every wildcard ``bind`` Mooncake's shared objects make in this process bind
    ``host`` instead (an IP address; a name is resolved): how many GOT entries were redirected
    now (0 where it was done before, or Mooncake has none to redirect)."""
    global _hook
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        address = socket.gethostbyname(host)
    with _lock:
        _target[:] = [address]
        import mooncake.store  # noqa: F401  (its objects loaded, to be found)

        if _hook is None:
            _hook = _BIND(_bind)
        hook = ctypes.cast(_hook, ctypes.c_void_p).value
        redirected = 0
        for path, base in _loaded_objects():
            if os.sep + "mooncake" + os.sep not in path or path in _patched:
                continue
            with contextlib.suppress(OSError):
                for offset in _bind_slots(path):
                    _write_pointer(base + offset, hook)
                    redirected += 1
                _patched.add(path)
        if not _patched:
            log.warning(
                "Mooncake's listeners could not be bound to %s: no bind of its own found; they "
                "listen on every interface",
                address,
            )
        return redirected
