"""``raykv bench route-weights`` on a tiny model: the slopes come out of real TTFTs on the local
engine, and the weights are their ratios."""

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


def test_route_weights_refuse_lengths_out_of_order(capsys) -> None:
    assert main(["bench", "route-weights", "--prompt-tokens", "512,256"]) == 2
    assert "two lengths, shorter first" in capsys.readouterr().err
