"""The model part of a step's plan: what each scheduled request computes and reads.

For every scheduled request: the KV its new tokens write in each group (positions, tokens, the
blocks they land in and those blocks' parent hashes: the synthetic model's KV is a function of
them), what changed in its block tables since the ranks last saw them, and, when its prompt
is all in, where in each table the token it samples starts to read.

With async scheduling a decode is planned before the step sampling its input token has
answered: that token is ``PENDING_TOKEN`` here, and the engine writes the real one in
(``fill_pending``) before the plan leaves.
"""

from __future__ import annotations

from collections.abc import Sequence

from raykv.connector.scheduled import ScheduledRequest
from raykv.core.block_pool import NULL_BLOCK
from raykv.core.hashing import parent_hash
from raykv.core.kv_cache import KVCacheManager
from raykv.core.step import ModelEntry

PENDING_TOKEN = -1  # a token a step in flight is sampling; never sent to a rank


def model_batch(
    scheduled: Sequence[ScheduledRequest], kv: KVCacheManager, parent_hashes: bool = True
) -> list[ModelEntry]:
    """One entry per scheduled request, in order (the entry's index is the request's position
    in the ranks' replies). ``parent_hashes``: the written blocks' (the synthetic model's KV is
    a function of them; a real model's is not)."""
    bs = kv.block_size
    batch = []
    for i, item in enumerate(scheduled):
        req, n = item.req, item.num_tokens
        start = item.start
        end = start + n
        first_b, last_b = start // bs, (end - 1) // bs
        tokens = req.tokens[start:end]
        tokens += [PENDING_TOKEN] * (n - len(tokens))
        assert all(NULL_BLOCK not in table[first_b : last_b + 1] for table in req.block_tables), (
            f"{req.req_id}: writing into a null block"
        )
        parents = []
        if parent_hashes:
            hashes = req.update_hashes(bs)
            parents = [parent_hash(hashes, b, req.root_hash) for b in range(first_b, last_b + 1)]
        # the prompt is all in: this step samples a token
        read_from = kv.read_from(end) if end == req.num_tokens + req.num_pending else []
        key, table_from, tables = kv.table_changes(req, end)
        batch.append(
            ModelEntry(i, key, start, tokens, tables, table_from, read_from, parents, req.sampling)
        )
    return batch


def pending_entries(scheduled: Sequence[ScheduledRequest]) -> list[int]:
    """The batch indices whose tokens include one a step in flight is still sampling."""
    return [
        i for i, item in enumerate(scheduled) if item.start + item.num_tokens > item.req.num_tokens
    ]


def fill_pending(
    batch: list[ModelEntry], scheduled: Sequence[ScheduledRequest], indices: Sequence[int]
) -> None:
    """Write the tokens the step before has now sampled into these entries."""
    for i in indices:
        entry, req = batch[i], scheduled[i].req
        start = entry.start
        tokens = req.tokens[start : start + len(entry.tokens)]
        if len(tokens) != len(entry.tokens):
            if not req.finished:
                raise RuntimeError(f"{req.req_id}: the token at {start + len(tokens)} never came")
            # ended by an error in the step before: what this entry computes is discarded, as
            # for a request that sampled its EOS there
            tokens += [0] * (len(entry.tokens) - len(tokens))
        entry.tokens = tokens
