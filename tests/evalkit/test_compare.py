"""The one comparison of greedy runs (evalkit.compare), on records written by hand."""

import json

import pytest

from evalkit.compare import compare, from_json

# three steps each; the reference's margins are 2.0, 0.1 (a near tie), 2.0
REF = {"tokens": [[1, 2, 3]], "logprobs": [[{1: -0.1, 5: -2.1}, {2: -0.60, 7: -0.70}, {3: -0.2, 6: -2.2}]]}


def run(tokens, logprobs):
    return {"tokens": [tokens], "logprobs": [logprobs]}


def test_identical_runs():
    out = compare(REF, REF)
    assert (out["prompts"], out["tokens_compared"], out["equal_up_to_tie"], out["whole_sequences_equal"]) == (1, 1, 1, 1)
    assert out["first_divergence"] == [3] and out["ref_margin_at_divergence"] == []
    assert out["dlogprob_max"] == 0.0


def test_a_choice_at_a_near_tie_is_not_a_difference():
    got = run([1, 7, 9], [{1: -0.15, 5: -2.0}, {7: -0.62, 2: -0.66}, {9: -0.3, 3: -1.0}])
    out = compare(got, REF)
    assert out["equal_up_to_tie"] == 1 and out["whole_sequences_equal"] == 0
    assert out["first_divergence"] == [1] and out["ref_margin_at_divergence"] == [pytest.approx(0.1)]
    # the shared context: step 0 (token 1) and step 1, where got reports the reference's token 2
    assert out["dlogprob_mean"] == pytest.approx((0.05 + 0.06) / 2)
    assert out["dlogprob_max"] == pytest.approx(0.06)


def test_a_difference_before_the_tie_is_caught():
    got = run([5, 2, 3], [{5: -0.5, 1: -0.6}, {2: -0.1, 7: -3.0}, {3: -0.1, 6: -3.0}])
    out = compare(got, REF)
    assert out["equal_up_to_tie"] == 0 and out["first_divergence"] == [0]
    assert out["dlogprob_max"] == pytest.approx(0.5)  # the reference's token 1 at step 0: -0.6 against -0.1


def test_without_a_second_token_every_step_counts():
    """A reference that reports one token a step shows no tie: the whole
    sequence must be equal."""
    ref = run([1, 2, 3], [{1: -0.1}, {2: -0.6}, {3: -0.2}])
    got = run([1, 2, 4], [{1: -0.1}, {2: -0.6}, {4: -0.3, 3: -0.4}])
    out = compare(got, ref)
    assert out["tokens_compared"] == 3 and out["equal_up_to_tie"] == 0
    assert out["ref_margin_at_divergence"] == [None]


def test_differences_survive_json():
    """JSON makes token ids strings; read back, a difference of 0.2 at the
    second token must show, not read as 0."""
    ref = run([1, 2, 3], [{1: -0.1, 5: -3.0}, {2: -0.1, 5: -3.0}, {3: -0.2, 6: -2.0}])
    got = run([1, 2, 3], [{1: -0.1, 5: -3.0}, {2: -0.3, 5: -3.0}, {3: -0.2, 6: -2.0}])
    got, ref = (from_json(json.loads(json.dumps(r))) for r in (got, ref))
    out = compare(got, ref)
    assert out["tokens_compared"] == 3 and out["whole_sequences_equal"] == 1
    assert out["dlogprob_max"] == pytest.approx(0.2) and out["dlogprob_mean"] == pytest.approx(0.2 / 3)
