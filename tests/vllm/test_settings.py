"""raykv's settings inside vLLM: the offload section's keys, defaults and checks, errors naming
``raykv.<key>``; a vLLM outside the supported range refused in one line."""

from __future__ import annotations

import pytest

from raykv.config import ConfigError
from raykv.config.sections import OffloadConfig
from raykv.vllm.settings import fault_settings, offload_settings
from raykv.vllm.versions import UnsupportedVllm, check_version


def test_the_inline_section_takes_raykv_run_s_keys_and_defaults() -> None:
    settings = offload_settings({"raykv": {"cpu_bytes": "2GiB", "disk": {"enabled": False}}})
    assert settings.cpu_bytes == 2 * 2**30
    assert settings.policy == "recall" and settings.take_hits == "faster"


@pytest.mark.parametrize(
    ("raykv", "named"),
    [
        ({"cpu_bytes": "lots"}, "raykv.cpu_bytes"),
        ({"cpu_bytes": "1GiB", "polcy": "lru"}, "raykv.polcy: unknown key"),
        ({"cpu_bytes": "1GiB", "disk": {"io_threads": 0}}, "raykv.disk.io_threads"),
        ({}, "raykv.cpu_bytes: set the CPU tier's size"),
        ({"cpu_slots": 8, "blocks_per_chunk": 2}, "raykv.blocks_per_chunk"),
        ({"cpu_slots": 8, "shared": {"enabled": True, "publish": "back"}}, "raykv.shared.publish"),
    ],
)
def test_a_bad_setting_is_named(raykv, named) -> None:
    with pytest.raises(ConfigError) as caught:
        offload_settings({"raykv": raykv})
    assert named in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_raykv_config_file_gives_its_offload_section(tmp_path) -> None:
    path = tmp_path / "raykv.yaml"
    path.write_text("offload:\n  cpu_slots: 12\n  policy: lru\n")
    settings = offload_settings({"raykv_config": str(path)})
    assert (settings.cpu_slots, settings.policy) == (12, "lru")
    with pytest.raises(ConfigError, match="not both"):
        offload_settings({"raykv_config": str(path), "raykv": {"cpu_slots": 1}})


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "garbage"])
def test_vllm_outside_the_supported_minors_is_refused(version) -> None:
    with pytest.raises(UnsupportedVllm, match=f"supports vLLM 0.32.x; this is vLLM {version}"):
        check_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.3+cpu"])
def test_supported_versions_pass(version) -> None:
    check_version(version)


NO_SHARED_TIER = OffloadConfig()


def test_faults_come_inline_or_from_the_file_with_raykv_run_s_specs(tmp_path) -> None:
    inline = fault_settings(
        {"raykv_faults": ["fail-disk:rate=0.5:rank=1"]}, world_size=2, settings=NO_SHARED_TIER
    )
    assert [(f.kind, f.rate, f.rank) for f in inline] == [("fail-disk", 0.5, 1)]
    path = tmp_path / "raykv.yaml"
    offload = "offload:\n  cpu_slots: 4\n  shared: {enabled: true}\n"
    path.write_text(offload + 'faults: ["kill-shared-master:step=7"]\n')
    extra = {"raykv_config": str(path)}
    assert [f.step for f in fault_settings(extra, 1, offload_settings(extra))] == [7]
    assert fault_settings({"raykv": {"cpu_slots": 4}}, 1, NO_SHARED_TIER) == []


@pytest.mark.parametrize(
    ("faults", "named"),
    [
        (["kill-worker:step=3:rank=0"], "raykv_faults[0]: kill-worker is not available inside"),
        (["fail-copy:rate=0.1", "drop-acks:rate=0.1"], "raykv_faults[1]: drop-acks"),
        (["corrupt-disk:rate=1:rank=2"], "raykv_faults[0]: rank 2 does not exist with 2"),
        (["slow-disk"], "raykv_faults[0]: fault 'slow-disk': slow-disk needs ms=N"),
        ("fail-copy:rate=1", "raykv_faults: expected a list"),
        (["kill-shared-master:step=3"], "raykv_faults[0]: kill-shared-master needs the shared"),
    ],
)
def test_a_fault_vllm_cannot_have_or_a_bad_spec_is_named(faults, named) -> None:
    with pytest.raises(ConfigError) as caught:
        fault_settings({"raykv_faults": faults}, world_size=2, settings=NO_SHARED_TIER)
    assert named in str(caught.value) and "\n" not in str(caught.value)


def offloading_config(raykv: dict):
    """vLLM's offloading config of a one-worker engine whose block is 64 KiB, with ``raykv``."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(128, ("layer.0",), 0),),
        worker_kv_bytes_per_block=64 << 10,
        enable_kv_cache_events=False,
        extra_config={"raykv": raykv},
        engine_id="raykv-settings-test",
        model=OffloadingModelConfig("model", "float32"),
        cache=OffloadingCacheConfig(128, 1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )


@pytest.mark.parametrize(
    ("raykv", "named"),
    [
        ({"cpu_bytes": 0}, "raykv.cpu_bytes: Input should be greater than 0"),
        ({"cpu_bytes": "1KiB"}, "raykv.cpu_bytes (1024) is smaller than one chunk"),
        (
            {"cpu_bytes": "1MiB", "disk": {"enabled": True, "path": "/tmp", "capacity": "1KiB"}},
            "raykv.disk.capacity (1024) is smaller than one chunk",
        ),
    ],
)
def test_a_tier_smaller_than_one_chunk_is_refused_naming_the_key(raykv, named) -> None:
    """Found by an audit: ``cpu_bytes: 0`` and ``1KiB`` were taken as one slot."""
    from raykv.vllm.spec import RaykvOffloadingSpec

    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        RaykvOffloadingSpec(offloading_config(raykv)).get_manager()
