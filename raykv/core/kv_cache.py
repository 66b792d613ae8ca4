"""The KV-cache manager: a request's block tables over the GPU block pool, one per KV group.

All block-table arithmetic lives here: the GPU prefix-cache hit, admission (cached blocks
revived, fresh ones allocated, all or nothing), growth, the sliding-window blocks that leave the
window, freeing, publishing full blocks to the prefix cache, and the most blocks a request can
need. Every allocation and every release of a running request's block, from every path, is
reported to one listener: the fence is only as good as that feed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from raykv.core.arith import cdiv
from raykv.core.block_pool import NULL_BLOCK, BlockPool
from raykv.core.keys import make_key
from raykv.core.kv_groups import KVGroup
from raykv.core.request import Request


class AllocationListener(Protocol):
    def on_allocated(
        self, req: Request, new_entries: Sequence[Sequence[int]], fresh: Sequence[int]
    ) -> None:
        """Entries were appended to each group's table (``NULL_BLOCK`` where a position needs
        no block); ``fresh`` are the blocks among them taken from the free pool (they will be
        written; revived prefix-cache blocks are only read)."""
        ...

    def on_released(self, req: Request, group: int, positions: Sequence[int]) -> None:
        """A running request gave back the blocks at ``positions`` of a sliding-window group's
        table (they left the window)."""
        ...


class KVCacheManager:
    """Block tables for every request, over one pool shared by every KV group."""

    def __init__(
        self,
        pool: BlockPool,
        groups: Sequence[KVGroup],
        block_size: int,
        max_num_batched_tokens: int,
        listener: AllocationListener | None = None,
    ) -> None:
        self.pool = pool
        self.groups = list(groups)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.listener = listener
        # the ranks keep every running request's tables between steps (a step sends only what
        # changed): the next key to give a table sent whole, the keys of tables whose requests
        # have freed their blocks since the last plan, and the epoch a recovery ends
        self._next_table_key = 0
        self._forgotten: list[int] = []
        self.tables_epoch = 0

    def max_blocks_needed(self, tokens: int) -> int:
        """The most blocks a request of ``tokens`` positions ever holds at once when it runs
        alone: every block for a full-attention group; for a sliding-window group its window
        plus one step's worth of new tokens (earlier blocks are freed as it goes)."""
        bs = self.block_size
        total = 0
        for group in self.groups:
            blocks = cdiv(tokens, bs)
            if group.is_sliding:
                assert group.window_tokens is not None
                # a step reads W - 1 earlier positions and writes up to a budget's worth
                span = group.window_tokens - 1 + self.max_num_batched_tokens
                blocks = min(blocks, cdiv(span, bs) + 1)
            total += blocks
        return total

    def local_hit(self, req: Request) -> tuple[int, list[list[int]]]:
        """The GPU prefix-cache hit: tokens, and per group the table entries covering them."""
        bs, pool = self.block_size, self.pool
        hashes = req.update_hashes(bs)
        limit = min(len(hashes), (req.num_tokens - 1) // bs)
        n = limit
        for g, group in enumerate(self.groups):
            if group.is_sliding:
                continue
            k = 0
            while k < n and pool.lookup(make_key(hashes[k], g)) is not None:
                k += 1
            n = k
        while n > 0 and not all(
            pool.lookup(make_key(hashes[b], g)) is not None
            for g, group in enumerate(self.groups)
            if group.is_sliding
            for b in range(group.first_needed_block(n * bs, bs), n)
        ):
            n -= 1
        tables = []
        for g, group in enumerate(self.groups):
            first = group.first_needed_block(n * bs, bs)
            tables.append(
                [
                    NULL_BLOCK if b < first else pool.lookup(make_key(hashes[b], g)) or NULL_BLOCK
                    for b in range(n)
                ]
            )
        return n * bs, tables

    def admit(self, req: Request, local: list[list[int]], start: int, end: int) -> bool:
        """Give a waiting request its cached blocks plus fresh ones for positions up to ``end``
        (computing or loading resumes at ``start``). All or nothing."""
        bs, pool = self.block_size, self.pool
        revive = fresh_needed = 0
        plans = []
        for group, table in zip(self.groups, local, strict=True):
            first = group.first_needed_block(start, bs)
            positions = range(len(table), cdiv(end, bs))
            fresh_needed += sum(1 for b in positions if b >= first)
            # only the cached blocks it keeps are taken from the free pool: those before a
            # window that starts past them (a load resumes later than the GPU hit) are not
            revive += sum(
                1
                for i, b in enumerate(table)
                if i >= first and b != NULL_BLOCK and pool.ref_count(b) == 0
            )
            plans.append((first, positions))
        if fresh_needed + revive > pool.num_free:
            return False
        new_entries: list[list[int]] = []
        fresh_all: list[int] = []
        # cached blocks before the window are not needed: keep only what is read. Revive every
        # group's cached blocks before allocating any fresh one, or an allocation could hand out
        # (and drop from the cache) a free block another group is about to revive.
        kept = [
            [b if i >= first else NULL_BLOCK for i, b in enumerate(table)]
            for (first, _), table in zip(plans, local, strict=True)
        ]
        for entries in kept:
            for b in entries:
                if b != NULL_BLOCK:
                    pool.acquire(b)
        for (first, positions), entries in zip(plans, kept, strict=True):
            fresh = pool.allocate(sum(1 for b in positions if b >= first))
            fresh_all += fresh
            it = iter(fresh)
            entries += [next(it) if b >= first else NULL_BLOCK for b in positions]
            new_entries.append(entries)
        for table, entries in zip(req.block_tables, new_entries, strict=True):
            table.extend(entries)
        req.num_cached_blocks = [len(t) for t in local]
        if self.listener is not None:
            self.listener.on_allocated(req, new_entries, fresh_all)
        return True

    def grow(self, req: Request, end: int) -> bool:
        """Extend a running request's tables to hold positions up to ``end``, first freeing the
        sliding-window blocks that the tokens computed from now on no longer read."""
        bs, pool = self.block_size, self.pool
        self._drop_out_of_window(req, req.num_computed)
        wanted = cdiv(end, bs)
        need = sum(max(0, wanted - len(table)) for table in req.block_tables)
        if need > pool.num_free:
            return False
        new_entries: list[list[int]] = []
        fresh_all: list[int] = []
        for table in req.block_tables:
            fresh = pool.allocate(max(0, wanted - len(table)))
            table.extend(fresh)
            fresh_all += fresh
            new_entries.append(fresh)
        if self.listener is not None and fresh_all:
            self.listener.on_allocated(req, new_entries, fresh_all)
        return True

    def _drop_out_of_window(self, req: Request, next_position: int) -> None:
        bs = self.block_size
        for g, (group, table) in enumerate(zip(self.groups, req.block_tables, strict=True)):
            if not group.is_sliding:
                continue
            first = min(group.first_needed_block(next_position, bs), len(table))
            positions = [i for i in range(first) if table[i] != NULL_BLOCK]
            if positions:
                if self.listener is not None:
                    self.listener.on_released(req, g, positions)
                self.pool.free(reversed([table[i] for i in positions]))
                for i in positions:
                    table[i] = NULL_BLOCK

    def free(self, req: Request) -> None:
        """Release every block (tails first, so they are reused first); the ranks drop their
        copy of the tables with the next plan."""
        blocks = [b for table in req.block_tables for b in reversed(table) if b != NULL_BLOCK]
        self.pool.free(blocks)
        if req.table_key >= 0:
            self._forgotten.append(req.table_key)
        req.reset_blocks(len(self.groups))

    def table_changes(self, req: Request, end: int) -> tuple[int, int, list[list[int]]]:
        """What the ranks need to hold ``req``'s tables up to position ``end - 1``: (its key,
        the first entry that changes, each group's entries from there). A table the ranks do not
        hold goes whole under a new key; one they hold sends only the entries past what they
        have (none on most decode steps), or from ``end``'s block on where the request went back
        (a failed load recomputes)."""
        wanted = cdiv(end, self.block_size)
        if req.table_key < 0:  # (its tables_sent is 0: reset_blocks keeps the two together)
            req.table_key = self._next_table_key
            self._next_table_key += 1
        start = min(req.tables_sent, wanted)
        req.tables_sent = wanted
        return req.table_key, start, [table[start:wanted] for table in req.block_tables]

    def take_forgotten(self) -> list[int]:
        """The keys of the tables the ranks are to drop (each handed out once)."""
        forgotten, self._forgotten = self._forgotten, []
        return forgotten

    def forget_rank_tables(self) -> None:
        """After a recovery: the ranks start a new epoch with no tables (new ranks have none,
        survivors drop theirs), so nothing queued for them to drop still matters. Every
        request's blocks have been freed by then."""
        self.tables_epoch += 1
        self._forgotten.clear()

    def publish(self, req: Request) -> None:
        """Publish the request's newly full, computed blocks to the GPU prefix cache."""
        bs, pool = self.block_size, self.pool
        hashes = req.update_hashes(bs)
        full = min(req.num_computed // bs, len(hashes))
        for g, table in enumerate(req.block_tables):
            for b in range(req.num_cached_blocks[g], min(full, len(table))):
                if table[b] != NULL_BLOCK:
                    pool.cache(table[b], make_key(hashes[b], g))
            req.num_cached_blocks[g] = max(req.num_cached_blocks[g], min(full, len(table)))

    def read_from(self, end: int) -> list[int]:
        """Per group, the first block the token at position ``end - 1`` attends to: with the
        tables up to that token, what the model reads to sample the next one
        (``ModelEntry.read_blocks``)."""
        return [group.first_needed_block(end - 1, self.block_size) for group in self.groups]
