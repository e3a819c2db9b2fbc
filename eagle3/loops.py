"""Repetition loops in answers, and the loss mask without their tails (data.loop_tokens).

A small target answering greedily falls into loops: the same line again and again until the token
budget ends. Loop tails are the easiest tokens there are to draft; left in, they can be most of an
answer's tokens, of the loss and of the held-out accept figures (bench/repetition_loops.py counts
them). eagle3.data.build_samples applies mask_loops to every conversation it renders.
"""
from __future__ import annotations

LOOP_NGRAM = 16   # tokens that make a repetition: a span this long seen before in the same answer


def answer_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s in a loss mask: one per answer."""
    runs, start = [], None
    for k, m in enumerate(mask):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append((start, k))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def mask_loops(ids: list[int], mask: list[int], keep: int, n: int = LOOP_NGRAM) -> list[int]:
    """The loss mask without the tails of repetition loops. In each answer (answer_runs), token k
    repeats when the n tokens ending at k occurred, as n tokens in a row, earlier in the same
    answer. Of each run of repeating tokens, the first `keep` stay in the mask (a drafter must still
    learn to follow a loop) and the rest leave it. keep <= 0: the mask unchanged."""
    out = list(mask)
    if keep <= 0:
        return out
    for i, j in answer_runs(mask):
        seen, run = set(), 0
        for k in range(i + n - 1, j):
            gram = tuple(ids[k - n + 1: k + 1])
            run = run + 1 if gram in seen else 0
            seen.add(gram)
            if run > keep:
                out[k] = 0
    return out
