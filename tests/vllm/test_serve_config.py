"""``raykv serve --engine vllm`` refuses what it cannot serve before anything is deployed: one
line naming the key, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from raykv.cli.main import main

VLLM = ["serve", "--engine", "vllm", "--set", "offload.enabled=true"]


@pytest.mark.parametrize(
    "sets,message",
    [
        (["serve.vllm.blok_size=32"], "serve.vllm.blok_size: not an engine argument of vLLM"),
        (["serve.vllm.model=other"], "serve.vllm.model: set by --model"),
        (["serve.vllm.kv_events_config={}"], "serve.vllm.kv_events_config: set by the replica"),
        (["serve.vllm.block_size=0"], "serve.vllm.block_size"),
        (["serve.replica_cpus=0"], "serve.replica_cpus"),
        (
            [
                "offload.cpu_bytes=1GiB",
                "offload.shared.enabled=true",
                "offload.shared.publish=back",
            ],
            "offload.shared.publish: back is not available inside vLLM",
        ),
    ],
)
def test_a_bad_vllm_setting_is_one_line_naming_it(
    sets: list[str], message: str, vllm_model: Path, capsys
) -> None:
    argv = [*VLLM, "--model", str(vllm_model)]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_the_vllm_baseline_needs_the_vllm_engine(capsys) -> None:
    assert main(["bench", "serve", "--router", "kv,vllm"]) == 2
    assert "--router vllm: vLLM's own server is the baseline of --engine vllm" in (
        capsys.readouterr().err
    )


def test_the_served_config_settles_vllms_block_size_and_the_models_limits(
    vllm_model: Path,
) -> None:
    from raykv.config import load_config
    from raykv.serve.app import kv_layout, router_kwargs, served_config

    cfg = load_config(None, [f"model.path={vllm_model}", "serve.engine=vllm"])
    served, directory = served_config(cfg)
    assert directory == str(vllm_model)
    assert served.serve.vllm.block_size == 128  # vLLM's CPU platform
    assert served.model.max_positions == 4096  # the checkpoint's max_position_embeddings
    layout = kv_layout(served)
    assert (layout.block_size, layout.hasher) == (128, "vllm:sha256")
    assert router_kwargs(served, "kv")["hasher"] == "vllm:sha256"
