"""vLLM's KV event stream as raykv's router reads it (``raykv.serve.vllm_events``): the decoder
on messages encoded by vLLM's own classes and encoder (its map encoding) and on the tagged-array
encoding, and the live stream of a real vLLM engine with raykv's tiers, whose every block hash
the router's own hashing (``raykv.vllm.block_hashes``) must reproduce."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from raykv.core.keys import make_key
from raykv.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_SHARED
from raykv.serve.kv_index import KVLayout, PromptKeys
from raykv.serve.vllm_events import (
    EventFormatError,
    EventSubscriber,
    VllmKVMirror,
    _frames,
    decode_batch,
)
from raykv.vllm.block_hashes import DEFAULT_SEED, prompt_hashes
from tests.vllm.conftest import BLOCK_TOKENS, engine, prompt_text

H = [bytes([i]) * 32 for i in range(1, 9)]  # block hashes as vLLM's sha256 gives them


def low(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


def vllm_batch(events: list) -> bytes:
    """A batch as vLLM's ZMQ publisher encodes it."""
    from vllm.distributed.kv_events import KVEventBatch

    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=1.0, events=events))


def test_the_decoder_reads_vllms_map_encoding_of_every_medium() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    def stored(hashes, medium, **kw):
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=list(range(4 * len(hashes))),
            block_size=4,
            lora_id=None,
            medium=medium,
            lora_name=None,
            **kw,
        )

    mirror = VllmKVMirror(blocks_per_chunk=2)
    payload = vllm_batch(
        [
            stored(H[:4], "GPU"),
            stored(H[:2], "CPU", group_idx=0),  # one chunk of two blocks: its key is H[1]
            stored(H[2:4], "CPU"),
            stored(H[:2], "STORAGE", locality="LOCAL", ownership="raykv-disk"),
            stored(H[2:4], "STORAGE", locality="REMOTE", ownership="raykv-shared"),
            BlockRemoved(block_hashes=H[:4], medium="CPU"),  # both chunks, every block
            BlockRemoved(block_hashes=[H[3]], medium="GPU"),
        ]
    )
    mirror.apply(0, decode_batch(payload))
    assert mirror.kv.gpu == {low(h) << 8 for h in H[:3]}
    assert mirror.kv.cpu == set()
    assert mirror.kv.disk == {make_key(low(H[1]))}
    assert mirror.kv.shared == {make_key(low(H[3]))}
    wire = mirror.take()
    assert [(stored, medium) for _, stored, medium, _ in wire] == [
        (True, MEDIUM_GPU),
        (True, MEDIUM_CPU),
        (True, MEDIUM_CPU),
        (True, MEDIUM_DISK),
        (True, MEDIUM_SHARED),
        (False, MEDIUM_CPU),
        (False, MEDIUM_GPU),
    ]
    assert [seq for seq, *_ in wire] == list(range(7))
    mirror.apply(1, decode_batch(vllm_batch([AllBlocksCleared()])))
    assert mirror.kv.gpu == set() and mirror.kv.disk  # the prefix cache only


def test_the_decoder_reads_the_tagged_array_encoding_and_vllms_int_hashes() -> None:
    mirror = VllmKVMirror()
    events = [
        ["BlockStored", [low(H[0]), low(H[1])], None, [1, 2], 1, None, "GPU"],
        ["BlockStored", [H[1]], None, [], 0, None, "CPU", None, None, 0],
        ["BlockRemoved", [H[0]], "GPU"],
        ["SomethingNew", 1, 2],  # a kind a later release adds: passed over
    ]
    payload = msgspec.msgpack.encode([2.5, events, 0])
    mirror.apply(None, decode_batch(payload))
    # an int hash is its low 64 bits, as vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES gives
    assert mirror.kv.gpu == {make_key(low(H[1]))}
    assert mirror.kv.cpu == {make_key(low(H[1]))}
    # a map batch (another publisher's) reads the same
    mirror.apply(None, decode_batch(msgspec.msgpack.encode({"ts": 1.0, "events": events[2:3]})))
    seq, events_read = _frames([b"kv", (5).to_bytes(8, "big"), payload])
    assert seq == 5 and len(events_read) == 3


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgspec.msgpack.encode(3), msgspec.msgpack.encode([1.0, [["BlockStored", 5]]])],
)
def test_a_malformed_message_is_an_error_naming_what_is_wrong(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_a_gap_in_the_stream_empties_the_mirror_instead_of_trusting_it() -> None:
    mirror = VllmKVMirror()
    batch = msgspec.msgpack.encode([1.0, [["BlockStored", [H[0]], None, [], 0, None, "CPU"]]])
    mirror.apply(0, decode_batch(batch))
    assert mirror.kv.cpu
    mirror.apply(2, [])  # batch 1 was lost
    assert not mirror.kv.cpu and mirror.gaps == 1


def test_vllms_seed_is_the_one_raykv_hashes_with() -> None:
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED

    assert DEFAULT_SEED == DEFAULT_NONE_HASH_SEED


def events_engine(model: Path, endpoint: str, disk: str):
    from vllm.config import KVEventsConfig

    raykv = {
        "cpu_bytes": f"{6 * 128 * 2 * 32 * 4 * 2 * 2}",  # six chunks of the tiny model
        "disk": {"enabled": True, "path": disk, "capacity": "64MiB"},
    }
    return engine(
        model,
        raykv,
        connector={"self_describing_kv_events": True},
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"
        ),
    )


def test_the_live_stream_shows_each_tiers_stores_and_removals_under_the_routers_keys(
    vllm_model: Path, tmp_path: Path
) -> None:
    from raykv.vllm.local import stores_landed

    sockets = tempfile.mkdtemp(prefix="raykv-events-")
    endpoint = f"ipc://{sockets}/events"
    mirror = VllmKVMirror()
    subscriber = EventSubscriber(endpoint, mirror)
    seen: list = []
    try:
        with events_engine(vllm_model, endpoint, str(tmp_path / "disk")) as llm:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            tokenizer = llm.get_tokenizer()
            prompts = [tokenizer.encode(prompt_text(seed, words=200)) for seed in range(4)]
            salted = TokensPrompt(prompt_token_ids=prompts[0], cache_salt="tenant-b")
            params = SamplingParams(temperature=0, max_tokens=2)
            time.sleep(0.5)  # the subscriber's connection is up before the first batch
            for prompt in prompts:
                llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
            llm.generate([salted], params, use_tqdm=False)
            assert stores_landed(llm, lambda i: [100 + i % 50], 60, pause_s=0.01)
            deadline = time.monotonic() + 10
            while not (mirror.kv.disk and mirror.kv.cpu) and time.monotonic() < deadline:
                time.sleep(0.05)
            seen = mirror.take()
            llm.reset_prefix_cache()
            llm.generate([[7] * 4], params, use_tqdm=False)  # a step publishes the clear
            deadline = time.monotonic() + 10
            while mirror.kv.gpu and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not mirror.kv.gpu, "the prefix cache's reset was not seen"
            seen += mirror.take()
    finally:
        subscriber.close()
    assert subscriber.errors == 0 and mirror.gaps == 0
    layout = KVLayout(BLOCK_TOKENS, 1, (0,), "vllm:sha256", None)
    stored = {medium: set() for medium in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)}
    removed = {medium: set() for medium in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK)}
    for _, is_stored, medium, keys in seen:
        (stored if is_stored else removed)[medium].update(keys)
    for prompt in prompts:
        keys = PromptKeys.of(prompt, layout)
        # every full block the router hashes is one vLLM published, in the prefix cache and
        # (written through) in raykv's CPU tier and on its disk
        assert {k for (k,) in keys.gpu} <= stored[MEDIUM_GPU]
        assert {k for (k,) in keys.cpu} <= stored[MEDIUM_CPU]
        assert {k for (k,) in keys.cpu} <= stored[MEDIUM_DISK]
    salted_keys = PromptKeys.of(prompts[0], layout, "tenant-b")
    assert {k for (k,) in salted_keys.gpu} <= stored[MEDIUM_GPU]
    unsalted = {k for (k,) in PromptKeys.of(prompts[0], layout).gpu}
    assert not {k for (k,) in salted_keys.gpu} & unsalted
    # the CPU tier holds six chunks: the later prompts evicted the first ones' (the disk keeps
    # them), and the mirror holds exactly what is left
    assert removed[MEDIUM_CPU], "no CPU-tier eviction was seen"
    assert stored[MEDIUM_CPU] - removed[MEDIUM_CPU] == mirror.kv.cpu
    assert len(mirror.kv.cpu) <= 6
    assert mirror.kv.disk == stored[MEDIUM_DISK] - removed[MEDIUM_DISK]


def test_the_routers_chain_is_vllms_own(monkeypatch) -> None:
    """raykv's chain against vLLM's ``hash_block_tokens`` from vLLM's ``NONE_HASH``, for each
    algorithm, a seed from PYTHONHASHSEED and a salted first block."""
    import importlib.util

    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    tokens = [(i * 37) % 5000 for i in range(3 * 16 + 5)]
    algos = ["sha256", "sha256_cbor"] + (["xxhash"] if importlib.util.find_spec("xxhash") else [])
    for algo in algos:
        for seed in (None, "1234"):
            if seed is None:
                monkeypatch.delenv("PYTHONHASHSEED", raising=False)
            else:
                monkeypatch.setenv("PYTHONHASHSEED", seed)
            hash_fn = get_hash_fn_by_name(algo)
            kv_cache_utils.init_none_hash(hash_fn)
            for salt in (None, "tenant"):
                parent, theirs = None, []
                for b in range(3):
                    extra = (("cache_salt", salt),) if b == 0 and salt else None
                    block = tokens[b * 16 : (b + 1) * 16]
                    parent = kv_cache_utils.hash_block_tokens(hash_fn, parent, block, extra)
                    theirs.append(int.from_bytes(parent[-8:], "big"))
                if algo.startswith("xxhash") and seed is None:
                    continue  # vLLM's own seed is random per process: nothing can agree
                assert prompt_hashes(tokens, 16, salt, algo, seed) == theirs, (algo, seed, salt)
