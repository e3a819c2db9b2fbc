"""Repetition loops in answers (eagle3/loops.py): which tokens of a loop stay in the loss.

The expected masks are worked out by hand on a built case, and against a slow implementation that
compares token slices directly on random answers with loops spliced in.
"""
import random

from eagle3.loops import answer_runs, mask_loops


def _loop_mask_by_hand(ids, mask, keep, n):
    """mask_loops written out the slow way: for every answer token, look for the same n tokens ending
    at an earlier position of the same answer by comparing slices; count repeats in a row."""
    out, start = list(mask), None
    for k in range(len(ids)):
        if not mask[k]:
            start = None
            continue
        start = k if start is None else start
        repeat = k - start + 1 >= n and any(ids[j - n + 1: j + 1] == ids[k - n + 1: k + 1]
                                            for j in range(start + n - 1, k))
        run = (run + 1 if repeat else 0) if k > start else 0
        if repeat and run > keep:
            out[k] = 0
    return out


def test_mask_loops_keeps_each_loops_start_and_drops_its_tail():
    # 4 prompt tokens, an answer of 20 distinct tokens then a period-5 loop 10 times, 2 prompt
    # tokens, then a second answer that is the first one's loop again (a new answer: nothing before
    # it counts)
    loop = [1, 2, 3, 4, 5] * 10
    ids = [900, 901, 902, 903] + list(range(100, 120)) + loop + [904, 905] + loop
    mask = [0] * 4 + [1] * 70 + [0] * 2 + [1] * 50
    assert answer_runs(mask) == [(4, 74), (76, 126)] and answer_runs([1, 0, 1]) == [(0, 1), (2, 3)]
    out = mask_loops(ids, mask, keep=8, n=16)
    # first answer (index 4 on): its 16-grams lie inside the loop from answer index 35, and the one
    # ending at answer index 40 is the one ending at 35 again: 30 repeats (40..69), the first 8 kept
    first = [k - 4 for k in range(4, 74) if mask[k] and not out[k]]
    assert first == list(range(48, 70))
    # second answer: the loop's first 16-gram ends at its index 15, repeats from 20 on: 30, 8 kept
    second = [k - 76 for k in range(76, len(ids)) if not out[k]]
    assert second == list(range(28, 50))
    assert out[:4] == [0] * 4 and out[74:76] == [0, 0]
    assert mask_loops(ids, mask, keep=0) == mask
    # against the slow way, on random answers with loops of random periods spliced in
    rng = random.Random(0)
    for _ in range(30):
        ids, mask = [], []
        for _ in range(rng.randint(1, 3)):
            ids += [rng.randrange(50) for _ in range(rng.randint(0, 5))]
            mask += [0] * (len(ids) - len(mask))
            ans = [rng.randrange(6) for _ in range(rng.randint(0, 40))]
            period = [rng.randrange(6) for _ in range(rng.randint(1, 7))]
            ans += period * rng.randint(0, 12) + [rng.randrange(6) for _ in range(rng.randint(0, 20))]
            ids += ans
            mask += [1] * len(ans)
        for keep, n in ((1, 4), (3, 6), (8, 16)):
            assert mask_loops(ids, mask, keep, n) == _loop_mask_by_hand(ids, mask, keep, n)
