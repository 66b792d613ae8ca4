"""``raykv bench route-weights`` on a tiny model: the slopes come out of real TTFTs on the local
engine (computed, loaded from the CPU tier, promoted from the disk tier and loaded), and the
weights are their ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raykv.cli import main


def test_route_weights_are_the_measured_ratios(tiny_chat_model: Path, tmp_path: Path, capsys):
    out = tmp_path / "weights.json"
    argv = [
        "bench",
        "route-weights",
        "--model",
        str(tiny_chat_model),
        "--prompt-tokens",
        "32,1024",
        "--decoders",
        "2,4",
        "--repeat",
        "2",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    m = json.loads(out.read_text())
    assert m["compute_s_per_token"] > 0 and m["load_s_per_token"] >= 0
    assert set(m["decode_delay_s"]) == {"2", "4"}
    assert m["cpu_hit_cost"] == pytest.approx(m["load_s_per_token"] / m["compute_s_per_token"])
    assert f"serve.router_weights.cpu_hit_cost={m['cpu_hit_cost']:.4f}" in printed
    # the same prompts a third time, from disk only: promoted into the CPU tier, then loaded
    assert m["disk_s_per_token"] >= 0
    assert m["disk_hit_cost"] == pytest.approx(m["disk_s_per_token"] / m["compute_s_per_token"])
    assert f"serve.router_weights.disk_hit_cost={m['disk_hit_cost']:.4f}" in printed
    # and on a second engine, from the shared tier the first one published to
    from raykv.transfer.shared_store import mooncake_problem

    shared = mooncake_problem() is None
    if shared:
        assert m["shared_s_per_token"] >= 0
        ratio = m["shared_s_per_token"] / m["compute_s_per_token"]
        assert m["shared_hit_cost"] == pytest.approx(ratio)
        assert f"serve.router_weights.shared_hit_cost={m['shared_hit_cost']:.4f}" in printed
    ways = {"computed", "cpu_tier", "disk_tier"} | ({"shared_tier"} if shared else set())
    assert set(m["ttft_s"]) == ways
    assert all(set(ttft) == {"32", "1024"} for ttft in m["ttft_s"].values())


def test_route_weights_without_the_lower_tiers_say_nothing_of_them(
    tiny_chat_model: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "weights.json"
    argv = ["bench", "route-weights", "--model", str(tiny_chat_model), "--no-disk", "--no-shared"]
    argv += ["--prompt-tokens", "32,64", "--decoders", "1", "--repeat", "1", "--json", str(out)]
    assert main(argv) == 0
    m = json.loads(out.read_text())
    assert m["disk_hit_cost"] is None and m["disk_s_per_token"] is None
    assert m["shared_hit_cost"] is None and m["shared_s_per_token"] is None
    assert set(m["ttft_s"]) == {"computed", "cpu_tier"}
    printed = capsys.readouterr().out
    assert "disk" not in printed and "shared" not in printed


def test_route_weights_refuse_lengths_out_of_order(capsys) -> None:
    assert main(["bench", "route-weights", "--prompt-tokens", "512,256"]) == 2
    assert "two lengths, shorter first" in capsys.readouterr().err
