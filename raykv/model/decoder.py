"""A Llama-family decoder whose attention reads and writes the paged KV cache in place.

The KV of layer ``l`` lives in the pages of its KV group: a page (one GPU block of that group)
is ``[layers_in_group, 2, kv_heads, block_size, head_dim]``, the layout the transfer engines
copy, so what the CPU tier stores and loads is exactly what the model reads. One step computes
any mix of requests: a prefill chunk (its prefix already in the pages, from the GPU prefix cache
or a CPU-tier load) or one decode token each; the linear layers run over every new token at
once, attention per request (gather the pages it reads, then ``scaled_dot_product_attention``).

Tensor parallel over ``tp_size`` ranks as Megatron does it: q/k/v and gate/up are split by
output (each rank holds its query and KV heads and its share of the MLP), o and down by input,
each followed by an all-reduce; embedding, norms and LM head are replicated, so every rank
computes the same logits. A rank's pages hold only its KV heads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raykv.core.arith import cdiv
from raykv.model.linear import Linear
from raykv.model.rope import apply_rotary, inverse_frequencies, rotary
from raykv.model.spec import KVPlacement, ModelSpec, UnsupportedModel


@dataclass(slots=True)
class SequenceChunk:
    """One request's part of a step: ``tokens`` at positions ``start ..`` (the KV of every
    earlier position is already in its pages), its block table per KV group, and whether the
    step samples after its last token."""

    tokens: Sequence[int]
    start: int
    block_tables: Sequence[Sequence[int]]
    sample: bool = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, scaled by ``weight`` in the input's dtype (as Llama does it)."""
    x32 = x.to(torch.float32)
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the TP group


@dataclass(slots=True)
class Read:
    """The KV one chunk's attention reads in one group: ``length`` positions starting
    ``skip`` positions into the first of ``blocks``, with a mask ``[queries, length]`` where
    not every query sees every position (``causal``: a whole prompt's plain causal mask)."""

    blocks: torch.Tensor
    skip: int
    length: int
    mask: torch.Tensor | None = None
    causal: bool = False


@dataclass(slots=True)
class DecodeBatch:
    """A step's decode tokens in one KV group, attended together: their ``rows`` in the flat
    token axis, the blocks each reads ``[b, width]`` (padded with block 0) and the mask
    ``[b, 1, 1, width * block_size]`` of the positions each sees."""

    rows: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor


class Decoder:
    """One rank's shard of the model (the whole model at ``tp_size`` 1)."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: Mapping[str, Any],
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        *,
        rank: int = 0,
        tp_size: int = 1,
        all_reduce: AllReduce | None = None,
    ) -> None:
        spec.check_tensor_parallel(tp_size)
        if tp_size > 1 and all_reduce is None:
            raise ValueError("a tensor-parallel decoder needs an all_reduce")
        self.spec = spec
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.placement, self.group_windows = KVPlacement.for_windows(spec.windows)
        self.num_heads = spec.num_heads // tp_size
        self.num_kv_heads = spec.num_kv_heads // tp_size
        self.all_reduce: AllReduce = all_reduce or (lambda x: x)
        q_rows = self.num_heads * spec.head_dim
        kv_rows = self.num_kv_heads * spec.head_dim
        mlp_rows = spec.intermediate_size // tp_size
        # (dimension split, this rank's slice) of every sharded tensor, by name suffix
        shards = {
            "self_attn.q_proj": (0, slice(rank * q_rows, (rank + 1) * q_rows)),
            "self_attn.k_proj": (0, slice(rank * kv_rows, (rank + 1) * kv_rows)),
            "self_attn.v_proj": (0, slice(rank * kv_rows, (rank + 1) * kv_rows)),
            "self_attn.o_proj": (1, slice(rank * q_rows, (rank + 1) * q_rows)),
            "mlp.gate_proj": (0, slice(rank * mlp_rows, (rank + 1) * mlp_rows)),
            "mlp.up_proj": (0, slice(rank * mlp_rows, (rank + 1) * mlp_rows)),
            "mlp.down_proj": (1, slice(rank * mlp_rows, (rank + 1) * mlp_rows)),
        }

        def get(name: str) -> torch.Tensor:
            if name not in weights:
                raise UnsupportedModel(f"the checkpoint has no tensor {name!r}")
            tensor = weights[name]
            module, _, kind = name.rpartition(".")
            for suffix, (dim, part) in shards.items():
                if module.endswith(suffix) and (kind == "weight" or dim == 0):
                    tensor = tensor[part] if dim == 0 else tensor[:, part]
            if not isinstance(tensor, torch.Tensor):  # a lazy slice of a file, read whole
                tensor = tensor[:]
            return tensor.to(device=self.device, dtype=dtype).contiguous()

        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        self.lm_head = Linear(self.embed if spec.tie_embeddings else get("lm_head.weight"))
        self.layers: list[dict[str, torch.Tensor]] = []  # norms
        # per layer: q, k and v as one product (split after), o, gate and up as one, down
        self.linears: list[dict[str, Linear]] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            layer = {
                name: get(p + name)
                for name in ("input_layernorm.weight", "post_attention_layernorm.weight")
            }
            if spec.qk_norm:
                for name in ("q_norm", "k_norm"):
                    layer[f"self_attn.{name}.weight"] = get(f"{p}self_attn.{name}.weight")
            self.layers.append(layer)
            qkv = [get(f"{p}self_attn.{name}.weight") for name in ("q_proj", "k_proj", "v_proj")]
            bias = None
            if spec.qkv_bias:
                bias = torch.cat(
                    [get(f"{p}self_attn.{name}.bias") for name in ("q_proj", "k_proj", "v_proj")]
                )
            gate_up = [get(f"{p}mlp.{name}.weight") for name in ("gate_proj", "up_proj")]
            self.linears.append(
                {
                    "qkv": Linear(torch.cat(qkv), bias),
                    "o": Linear(get(f"{p}self_attn.o_proj.weight")),
                    "gate_up": Linear(torch.cat(gate_up)),
                    "down": Linear(get(f"{p}mlp.down_proj.weight")),
                }
            )
        self._qkv_split = (q_rows, kv_rows, kv_rows)
        self._mlp_rows = mlp_rows
        inv_freq = inverse_frequencies(spec.rope, spec.head_dim)
        if "rope_freqs.weight" in weights:  # a GGUF file's precomputed scaling (llama3)
            factors = weights["rope_freqs.weight"]
            factors = factors if isinstance(factors, torch.Tensor) else factors[:]
            inv_freq = inv_freq / factors.to(torch.float32)
        self.inv_freq = inv_freq.to(self.device)

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One page of this rank's KV: every layer of a group, K and V, its KV heads."""
        s = self.spec
        return (self.placement.layers_per_group, 2, self.num_kv_heads, self.block_size, s.head_dim)

    def forward(self, chunks: Sequence[SequenceChunk], kv: torch.Tensor) -> torch.Tensor:
        """Compute one step: write every new token's KV into ``kv`` (``[num_blocks,
        page_elems]``) and return the logits ``[sampling chunks, vocab]`` (float32) of each
        sampling chunk's last token."""
        s, dev = self.spec, self.device
        pages = kv.view(kv.shape[0], *self.page_shape)
        tokens = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.long, device=dev)
        positions = torch.cat(
            [torch.arange(c.start, c.start + len(c.tokens), device=dev) for c in chunks]
        )
        spans = []  # (first row, rows) of each chunk in the flat token axis
        row = 0
        for c in chunks:
            spans.append((row, len(c.tokens)))
            row += len(c.tokens)
        cos, sin = rotary(self.inv_freq, positions)
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        # per group, once for every layer: where the step's new tokens' KV goes (one write
        # for all of them), what each prompt chunk's attention reads back, and the decode
        # tokens, which attend together as one padded batch
        targets = [self._slots(chunks, g) for g in range(len(self.group_windows))]
        singles = [i for i, c in enumerate(chunks) if len(c.tokens) == 1]
        longer = [i for i, c in enumerate(chunks) if len(c.tokens) > 1]
        prompts = [
            [(*spans[i], self._reads(chunks[i], g)) for i in longer]
            for g in range(len(self.group_windows))
        ]
        decodes = [
            self._decode_batch([chunks[i] for i in singles], [spans[i][0] for i in singles], g)
            if singles
            else None
            for g in range(len(self.group_windows))
        ]
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            g, li = self.placement.group_of[i], self.placement.index_in_group[i]
            linear = self.linears[i]
            h = rms_norm(x, layer["input_layernorm.weight"], s.rms_eps)
            q, k, v = linear["qkv"](h).split(self._qkv_split, dim=-1)
            q = q.reshape(-1, self.num_heads, s.head_dim)
            k = k.reshape(-1, self.num_kv_heads, s.head_dim)
            v = v.reshape(-1, self.num_kv_heads, s.head_dim)
            if s.qk_norm:
                q = rms_norm(q, layer["self_attn.q_norm.weight"], s.rms_eps)
                k = rms_norm(k, layer["self_attn.k_norm.weight"], s.rms_eps)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            blocks, offsets = targets[g]
            pages[blocks, li, 0, :, offsets] = k.to(pages.dtype)
            pages[blocks, li, 1, :, offsets] = v.to(pages.dtype)
            out = torch.empty_like(q)
            for first, n, read in prompts[g]:
                out[first : first + n] = self._attend(q[first : first + n], pages, li, read)
            batch = decodes[g]
            if batch is not None:
                out[batch.rows] = self._attend_decodes(q[batch.rows], pages, li, batch)
            x = x + self.all_reduce(linear["o"](out.reshape(len(tokens), -1)))
            h = rms_norm(x, layer["post_attention_layernorm.weight"], s.rms_eps)
            gate, up = linear["gate_up"](h).split(self._mlp_rows, dim=-1)
            x = x + self.all_reduce(linear["down"](F.silu(gate) * up))
        last = [first + n - 1 for c, (first, n) in zip(chunks, spans, strict=True) if c.sample]
        h = rms_norm(x[last], self.norm, s.rms_eps)
        return self.lm_head(h).to(torch.float32)

    def _slots(
        self, chunks: Sequence[SequenceChunk], group: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The (block, offset in block) of every new token of the step in KV group ``group``,
        in the flat token order."""
        bs = self.block_size
        blocks: list[int] = []
        offsets: list[int] = []
        for c in chunks:
            table = c.block_tables[group]
            for p in range(c.start, c.start + len(c.tokens)):
                blocks.append(table[p // bs])
                offsets.append(p % bs)
        return (
            torch.tensor(blocks, dtype=torch.long, device=self.device),
            torch.tensor(offsets, dtype=torch.long, device=self.device),
        )

    def _decode_batch(
        self, chunks: Sequence[SequenceChunk], rows: Sequence[int], group: int
    ) -> DecodeBatch:
        """The single-token chunks of a step in KV group ``group`` as one batch: each one's
        blocks padded to the longest (with block 0, masked out) and which positions of them
        it sees (its prefix, or the sliding window of it)."""
        bs = self.block_size
        tables: list[list[int]] = []
        spans: list[tuple[int, int]] = []  # (first position read, positions read)
        for c in chunks:
            lo, end = self._read_range(c, group)
            tables.append(list(c.block_tables[group][lo // bs : cdiv(end, bs)]))
            spans.append((lo % bs, end - lo))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        where = torch.arange(width * bs, device=dev)[None, :]
        skip = torch.tensor([lo for lo, _ in spans], device=dev)[:, None]
        length = torch.tensor([n for _, n in spans], device=dev)[:, None]
        mask = (where >= skip) & (where < skip + length)
        return DecodeBatch(
            torch.tensor(rows, dtype=torch.long, device=dev),
            torch.tensor(padded, dtype=torch.long, device=dev),
            mask[:, None, None, :],
        )

    def _read_range(self, chunk: SequenceChunk, group: int) -> tuple[int, int]:
        """The positions ``[lo, end)`` a chunk's attention reads in KV group ``group``: its
        whole prefix, or the sliding window its first query sees."""
        window = self.group_windows[group]
        end = chunk.start + len(chunk.tokens)
        return (0 if window is None else max(0, chunk.start - window + 1)), end

    def _reads(self, chunk: SequenceChunk, group: int) -> Read:
        """What a chunk's attention in KV group ``group`` reads: the whole prefix, or a sliding
        window of it, as the blocks that hold it, and the mask over those positions (None:
        every position is visible to every query, as for a decode token; ``causal``: the plain
        causal mask of a whole prompt)."""
        window = self.group_windows[group]
        lo, end = self._read_range(chunk, group)
        bs = self.block_size
        table = chunk.block_tables[group]
        blocks = torch.tensor(table[lo // bs : cdiv(end, bs)], dtype=torch.long, device=self.device)
        read = Read(blocks, lo % bs, end - lo)
        if chunk.start == 0 and window is None:
            read.causal = True
        elif len(chunk.tokens) > 1:
            q_pos = torch.arange(chunk.start, end, device=self.device)[:, None]
            k_pos = torch.arange(lo, end, device=self.device)[None, :]
            read.mask = k_pos <= q_pos
            if window is not None:
                read.mask &= q_pos - k_pos < window
        return read

    def _gather(self, pages: torch.Tensor, index: int, blocks: torch.Tensor) -> torch.Tensor:
        """K and V of layer ``index`` in ``blocks``, as ``[2, kv_heads, blocks, bs, head_dim]``
        in one copy of just those blocks (a view of the pages with the block axis inside,
        selected along it: selecting first and permuting after would copy twice)."""
        heads_inside = pages[:, index].permute(1, 2, 0, 3, 4)
        return heads_inside.index_select(2, blocks)

    def _attend(self, q: torch.Tensor, pages: torch.Tensor, index: int, read: Read) -> torch.Tensor:
        """Attention of one chunk's queries ``[n, heads, head_dim]`` over the KV of layer
        ``index`` of its group, read as ``_reads`` says."""
        n, heads, head_dim = q.shape
        kv_heads = self.num_kv_heads
        repeat = heads // kv_heads
        both = self._gather(pages, index, read.blocks).to(q.dtype)
        both = both.view(2, kv_heads, -1, head_dim)
        both = both[:, :, read.skip : read.skip + read.length]
        keys, values = both[0][None], both[1][None]
        if read.causal:  # a whole prompt: its query heads one by one against their KV head
            queries = q.transpose(0, 1)[None]
            keys = keys.repeat_interleave(repeat, dim=1)
            values = values.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
            return out[0].transpose(0, 1)
        # the query heads that share a KV head attend together, as one longer query: no copy
        # of the keys per query head ([1, kv_heads, repeat * n, head_dim])
        queries = q.view(n, kv_heads, repeat, head_dim).permute(1, 2, 0, 3)
        queries = queries.reshape(1, kv_heads, repeat * n, head_dim)
        mask = None if read.mask is None else read.mask.repeat(repeat, 1)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        out = out.view(kv_heads, repeat, n, head_dim).permute(2, 0, 1, 3)
        return out.reshape(n, heads, head_dim)

    def _attend_decodes(
        self, q: torch.Tensor, pages: torch.Tensor, index: int, batch: DecodeBatch
    ) -> torch.Tensor:
        """Attention of a step's decode tokens ``[b, heads, head_dim]``, one per request, over
        the KV of layer ``index`` of their group, in one padded batch."""
        b, heads, head_dim = q.shape
        kv_heads = self.num_kv_heads
        both = self._gather(pages, index, batch.blocks.flatten()).to(q.dtype)
        both = both.view(2, kv_heads, b, -1, head_dim).transpose(1, 2)  # [2, b, kvh, L, hd]
        queries = q.view(b, kv_heads, heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(queries, both[0], both[1], attn_mask=batch.mask)
        return out.reshape(b, heads, head_dim)
