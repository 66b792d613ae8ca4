"""The model part of a step's plan: what each scheduled request computes and reads.

For every scheduled request: the KV its new tokens write in each group (positions, tokens, the
blocks they land in and those blocks' parent hashes: the synthetic model's KV is a function of
them), and, when its prompt is all in, the blocks the model reads to sample the next token.
"""

from __future__ import annotations

from collections.abc import Sequence

from raykv.connector.scheduler import ScheduledRequest
from raykv.core.block_pool import NULL_BLOCK
from raykv.core.hashing import parent_hash
from raykv.core.kv_cache import KVCacheManager
from raykv.core.step import ModelEntry, WriteSpan


def model_batch(scheduled: Sequence[ScheduledRequest], kv: KVCacheManager) -> list[ModelEntry]:
    """One entry per scheduled request, in order (the entry's index is the request's position
    in the ranks' replies)."""
    bs = kv.block_size
    batch = []
    for i, item in enumerate(scheduled):
        req, n = item.req, item.num_tokens
        start = item.start
        end = start + n
        hashes = req.update_hashes(bs)
        first_b, last_b = start // bs, (end - 1) // bs
        tokens = req.tokens[start:end]
        writes = []
        for g, table in enumerate(req.block_tables):
            blocks = table[first_b : last_b + 1]
            assert NULL_BLOCK not in blocks, f"{req.req_id}: writing into a null block"
            parents = [parent_hash(hashes, b) for b in range(first_b, last_b + 1)]
            writes.append(WriteSpan(g, start, tokens, blocks, parents))
        # the prompt is all in: this step samples a token
        read = kv.sampled_blocks(req, end) if end == req.num_tokens else []
        tables = [list(table[: last_b + 1]) for table in req.block_tables]
        batch.append(ModelEntry(i, writes, read, end, tables, req.sampling))
    return batch
