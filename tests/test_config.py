"""Config validation: defaults, sizes, overrides, and errors that name the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from raykv.config import ConfigError, load_config, parse_size


def test_defaults() -> None:
    cfg = load_config()
    assert cfg.offload.enabled and cfg.offload.policy == "recall"
    assert cfg.offload.cpu_bytes is None and cfg.offload.blocks_per_chunk == 1


@pytest.mark.parametrize(
    "text,expected",
    [
        (4096, 4096),
        ("4096", 4096),
        ("2GiB", 2 * 1024**3),
        ("512 MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("8kib", 8192),
        (3.0, 3),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["2XB", "GiB", "-1", -5, True, "1.5.5GB", None, 2.5])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize(
    "tree,message",
    [
        ({"offload": {"cpu_bytes": "2XB"}}, "offload.cpu_bytes: not a size"),
        ({"offload": {"bogus": 1}}, r"offload.bogus: unknown key \(got 1\)"),
        ({"offlaod": {}}, "offlaod: unknown key"),
        ({"offload": {"blocks_per_chunk": 0}}, r"offload.blocks_per_chunk: .* \(got 0\)"),
        ({"offload": {"enabled": "maybe"}}, r"offload.enabled: .* \(got 'maybe'\)"),
        ({"offload": {"store_threshold": -1}}, "offload.store_threshold"),
        ({"offload": {"policy": "a b"}}, "offload.policy: neither a policy name"),
        ({"offload": {"cpu_bytes": "1GiB", "cpu_slots": 3}}, "offload: cpu_bytes .* exclusive"),
        ({"offload": 5}, "offload: "),
        # waits are bounded by time now: the old key says where the bound went
        ({"engine": {"max_deferred_steps": 64}}, "max_deferred_steps is gone.*engine.max_wait_s"),
    ],
)
def test_errors_name_the_key_path_and_value(tree: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(tree)


def test_yaml_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("offload:\n  cpu_bytes: 1GiB\n  policy: arc\n")
    cfg = load_config(path, ["offload.policy=lru", "offload.store_threshold=2"])
    assert cfg.offload.cpu_bytes == 1024**3
    assert (cfg.offload.policy, cfg.offload.store_threshold) == ("lru", 2)


def test_file_errors_name_the_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("offload:\n  cpu_bytes: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+:\d+: malformed YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(top)
    typo = tmp_path / "typo.yaml"
    typo.write_text("offload:\n  polcy: lru\n")
    with pytest.raises(ConfigError, match=r"in .*typo\.yaml: offload\.polcy: unknown key"):
        load_config(typo)
    typo.write_text("offload:\n  polcy: lru\ncache:\n  block_size: big\n")
    with pytest.raises(
        ConfigError, match=r"typo\.yaml:\n  cache\.block_size: .*\n  offload\.polcy"
    ):
        load_config(typo)  # several mistakes: one line each


def test_yaml_is_parsed_safely(tmp_path: Path) -> None:
    evil = tmp_path / "evil.yaml"
    evil.write_text("offload: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="malformed YAML"):
        load_config(evil)


@pytest.mark.parametrize(
    "override,message",
    [
        ("offload.policy", "expected key.path=value"),
        ("=3", "expected key.path=value"),
        ("offload..policy=x", "empty key"),
        ("offload.policy.name=x", "offload.policy is a value"),
        ("offload.cpu_slots=[1", "not valid YAML"),
        ("offload.cpu_slots=-4", "offload.cpu_slots"),
    ],
)
def test_bad_overrides(override: str, message: str) -> None:
    base = {"offload": {"policy": "lru"}}
    with pytest.raises(ConfigError, match=message):
        load_config(base, [override])


def test_shipped_configs_validate() -> None:
    configs = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)
