"""CRC-32 as zlib computes it, from ISA-L where it is installed (``isal``: about 9 GB/s on this
machine against zlib's 2.8, which made the checksum most of what a disk-tier read cost beyond
the disk itself). The values are zlib's, so files and pool checksums mean the same whichever
library computed them. Both release the GIL over large buffers."""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without a wheel: zlib's, slower, the same values
    from zlib import crc32

__all__ = ["crc32"]
