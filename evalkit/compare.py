"""Greedy runs compared one way everywhere: tokens must be equal up to the
reference's first near tie, and log-probabilities are compared wherever both
runs saw the same context.

Past a near tie (the reference's top two log-probabilities less than ``TIE``
apart) either token is a right answer, and the runs may part for good; before
it a different token is a real difference. The tie is found from the
reference alone, before the other run is looked at.
"""

from __future__ import annotations

TIE = 0.25  # top-2 logprob margin under which a greedy choice is a coin toss (4 bf16 steps)


def record(outputs) -> dict:
    """Tokens and each step's ``{token: logprob}`` of vLLM ``RequestOutput``s,
    ready for JSON (generate with ``logprobs=2`` so ties can be found)."""
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "logprobs": [[{int(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs]
                         for o in outputs]}


def from_json(run: dict) -> dict:
    """A record read back from JSON, whose keys are strings: left so, no
    token would be found and every logprob difference would read 0."""
    return {**run, "logprobs": [[{int(t): lp for t, lp in step.items()} for step in seq] for seq in run["logprobs"]]}


def margin(step: dict) -> float | None:
    """Top-1 minus top-2 logprob of one step; None where only one was reported."""
    top = sorted(step.values(), reverse=True)
    return top[0] - top[1] if len(top) > 1 else None


def decidable(ref: dict, tie: float = TIE) -> list[int]:
    """Per sequence, the steps the reference takes before its first near tie
    (all of them where no step reports a second token)."""
    return [next((i for i, step in enumerate(seq) if (m := margin(step)) is not None and m < tie), len(seq))
            for seq in ref["logprobs"]]


def compare(got, ref, tie: float = TIE) -> dict:
    """``got`` against the reference ``ref`` (records, or vLLM outputs):
    sequences equal up to the reference's first near tie (``equal_up_to_tie``
    of ``prompts``, over ``tokens_compared`` tokens), whole sequences equal,
    where each first differs and the reference's margin there, and |dlogprob|
    of the reference's token at every step whose context both runs share (up
    to and including the first differing one, where ``got`` reports it)."""
    got, ref = (run if isinstance(run, dict) else record(run) for run in (got, ref))
    clear = decidable(ref, tie)
    first, margins, diffs = [], [], []
    for a, b, la, lb in zip(got["tokens"], ref["tokens"], got["logprobs"], ref["logprobs"]):
        f = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first.append(f)
        if f < len(b):
            margins.append(margin(lb[f]))
        diffs += [abs(la[i][t] - lb[i][t]) for i, t in enumerate(b[: f + 1]) if i < len(la) and t in la[i]]
    return {"prompts": len(ref["tokens"]), "tokens_compared": sum(clear),
            "equal_up_to_tie": sum(a[:k] == b[:k] for a, b, k in zip(got["tokens"], ref["tokens"], clear)),
            "whole_sequences_equal": sum(a == b for a, b in zip(got["tokens"], ref["tokens"])),
            "first_divergence": first, "ref_margin_at_divergence": margins,
            "dlogprob_mean": sum(diffs) / max(len(diffs), 1), "dlogprob_max": max(diffs, default=0.0)}
