"""Sampling: greedy, temperature with top-k and top-p, per-request seeds, log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from raykv.model.sampling import SamplingParams, sample_token

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_takes_the_largest_logit_and_reports_its_logprob() -> None:
    s = sample_token(LOGITS, SamplingParams(logprobs=2), position=0)
    assert s.token_id == 0
    assert s.logprob == pytest.approx(float(torch.log_softmax(LOGITS, 0)[0]), abs=1e-6)
    assert list(s.top) == [0, 1] and s.top[0] == pytest.approx(s.logprob)


def test_a_seed_gives_the_same_tokens_and_other_seeds_other_ones() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    first = [sample_token(LOGITS, params, p).token_id for p in range(40)]
    again = [sample_token(LOGITS, params, p).token_id for p in range(40)]
    other = [
        sample_token(LOGITS, SamplingParams(temperature=1.0, seed=8), p).token_id for p in range(40)
    ]
    assert first == again and first != other


def test_temperature_one_follows_the_model_distribution() -> None:
    draws = [
        sample_token(LOGITS, SamplingParams(temperature=1.0, seed=3), p).token_id
        for p in range(4000)
    ]
    probs = torch.softmax(LOGITS, 0)
    for token in range(len(LOGITS)):
        share = draws.count(token) / len(draws)
        sigma = math.sqrt(float(probs[token]) * (1 - float(probs[token])) / len(draws))
        assert abs(share - float(probs[token])) < 5 * sigma + 1e-3


def test_top_k_and_top_p_keep_only_the_likeliest_tokens() -> None:
    top2 = {
        sample_token(LOGITS, SamplingParams(1.0, top_k=2, seed=1), p).token_id for p in range(300)
    }
    assert top2 == {0, 1}
    # tokens 0 and 1 hold about 0.72 of the mass: top_p 0.7 keeps both, nothing else
    nucleus = {
        sample_token(LOGITS, SamplingParams(1.0, top_p=0.7, seed=2), p).token_id for p in range(300)
    }
    assert nucleus == {0, 1}
    assert {
        sample_token(LOGITS, SamplingParams(1.0, top_p=0.01, seed=2), p).token_id for p in range(50)
    } == {0}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k")],
)
def test_bad_parameters_are_refused_by_name(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
