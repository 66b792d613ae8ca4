"""Tenants through ``raykv serve`` (real Ray Serve, the tiny served model, the openai client): a
request with another API key or another ``cache_salt`` gets no cached token of a prompt another
tenant sent, one of the same tenant does; and a server stopped and started again on the same
disk path answers a prompt it served before from the disk tier (the stop spilled its CPU tier)."""

from __future__ import annotations

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from raykv.config import load_config  # noqa: E402
from raykv.serve.tenants import SaltRequired, api_keys, request_salt, tenant_tag  # noqa: E402

PORT = 8128
KEYS = ("key-of-tenant-a", "key-of-tenant-b")


def test_salts_by_isolation_mode() -> None:
    a, b = tenant_tag(KEYS[0]), tenant_tag(KEYS[1])
    assert a != b and KEYS[0] not in a
    assert api_keys(" k1, k2 ,,") == ["k1", "k2"] and api_keys(None) == []
    assert request_salt("per_key", a, None) != request_salt("per_key", b, None)
    assert request_salt("per_key", a, "s") not in (request_salt("per_key", a, None), "s")
    assert request_salt("per_key", None, "s") == "s"  # a server without keys
    assert request_salt("request_salt", a, "s") == request_salt("request_salt", b, "s") == "s"
    assert request_salt("request_salt", a, None) is None
    with pytest.raises(SaltRequired):
        request_salt("required", a, None)
    assert request_salt("required", a, "s") == request_salt("per_key", a, "s")
    # the longest salt the API takes stays one the engine takes under a tenant (it was refused)
    from raykv.core.hashing import MAX_SALT_CHARS, check_cache_salt

    check_cache_salt(request_salt("per_key", a, "x" * MAX_SALT_CHARS))


def cached(client, model: str, prompt: str, **extra) -> tuple[int, int, str, int]:
    """Cached tokens, of them the disk tier's, the answer, and the prompt's tokens."""
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=3, temperature=0, extra_body=extra or None
    )
    details = out.usage.prompt_tokens_details
    return (
        details.cached_tokens,
        details.disk_tier_tokens,
        out.choices[0].text,
        out.usage.prompt_tokens,
    )


def test_tenants_share_no_cached_token_and_a_restart_answers_from_disk(
    ray_session, tiny_chat_model: Path, tmp_path: Path
) -> None:
    from raykv.serve.app import ServeOptions, Server

    sets = [
        f"model.path={tiny_chat_model}",
        "model.dtype=float32",
        "cache.num_gpu_blocks=160",
        "offload.cpu_slots=160",
        "offload.take_hits=always",  # every hit loaded: isolation, not the choice, is tested
        "offload.disk.enabled=true",
        f"offload.disk.path={tmp_path / 'disk'}",
        "offload.disk.capacity=256MiB",
        f"offload.shared_pool_dir={tmp_path}",
    ]
    model = tiny_chat_model.name
    prompt = "The quarterly figures of the northern mill, line by line: " + " ".join(
        f"item {i} weighs {i * 7 % 13} units;" for i in range(60)
    )
    options = ServeOptions(port=PORT, api_key=",".join(KEYS))
    server = Server(load_config(None, sets), options).start()
    try:
        url = server.url + "/v1"
        a = openai.OpenAI(base_url=url, api_key=KEYS[0], max_retries=0)
        b = openai.OpenAI(base_url=url, api_key=KEYS[1], max_retries=0)
        first = cached(a, model, prompt)
        assert first[0] == 0
        # another key: another tenant, nothing cached (it was: 496 of 505 tokens)
        other = cached(b, model, prompt)
        assert other[0] == 0 and other[2] == first[2]
        # the same key: cached
        again = cached(a, model, prompt)
        assert again[0] > 0 and again[2] == first[2]
        # the same key, another cache_salt: nothing; the same salt again: cached
        assert cached(a, model, prompt, cache_salt="project-x")[0] == 0
        assert cached(a, model, prompt, cache_salt="project-x")[0] > 0
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            cached(a, model, prompt, cache_salt="")
    finally:
        server.stop()
    files = list((tmp_path / "disk").rglob("*.kv"))
    assert files  # the stop spilled the CPU tier (as SIGTERM's stop does)
    # started again with a CPU tier that holds the prompt's chunks and little more: the first
    # request, alone on an idle engine, gets every full chunk from disk (it got none: its wait
    # was counted in the idle engine's short steps, and its promotion was refused the slots
    # the demotions keep free)
    restart = [*sets, "offload.cpu_slots=48"]
    server = Server(load_config(None, restart), options).start()
    try:
        a = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)
        warm = cached(a, model, prompt)
        full = (warm[3] - 1) // 16 * 16
        assert 24 < full // 16 < 48  # more chunks than half the tier, fewer than all of it
        assert warm[1] == warm[0] == full and warm[2] == first[2]
        # a salt nobody used finds none of the warm disk tier
        assert cached(a, model, prompt, cache_salt="fresh")[0] == 0
    finally:
        server.stop()
