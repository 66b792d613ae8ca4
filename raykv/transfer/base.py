"""What the CPU and CUDA transfer engines share."""

from __future__ import annotations

from types import TracebackType

from raykv.core.step import TransferStats


class TransferEngineBase:
    """Context management and per-job accounting common to the transfer engines."""

    def shutdown(self, wait: bool = True) -> None:
        raise NotImplementedError

    def take_corrupt(self) -> list[int]:
        """Loads that failed since the last call because a source row's checksum no longer
        matched (engines that keep no checksums report none)."""
        return []

    def __enter__(self) -> TransferEngineBase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    @staticmethod
    def count_job(
        stats: TransferStats, is_store: bool, blocks: int, page_bytes: int, seconds: float, ok: bool
    ) -> None:
        """Jobs, blocks and bytes count successful jobs; seconds count every copy's time."""
        if is_store:
            if ok:
                stats.store_jobs += 1
                stats.store_blocks += blocks
                stats.store_bytes += blocks * page_bytes
            stats.store_seconds += seconds
        else:
            if ok:
                stats.load_jobs += 1
                stats.load_blocks += blocks
                stats.load_bytes += blocks * page_bytes
            stats.load_seconds += seconds
