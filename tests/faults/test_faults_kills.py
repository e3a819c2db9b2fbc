"""The CI subset of `python -m eagle3.faults`: each job kind is killed twice at seeded moments, one
drawn over the whole job and one counted from its first write, resumed, and compared with its uninterrupted run.
A few minutes on 2 CPU cores; the large counts go through the command (docs/reliability.md).

Run: .venv/bin/python -m pytest tests/faults/test_faults_kills.py -q
"""
import pytest

from eagle3.faults import KINDS, Harness, draw_delays, same_dataset, table

SEED = 0


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return Harness(tmp_path_factory.mktemp("faults"))


def test_delays_are_seeded_per_kind_so_a_failure_replays():
    assert draw_delays(3, "train", 4, 10.0, 6.0) == draw_delays(3, "train", 4, 10.0, 6.0)
    assert draw_delays(3, "train", 4, 10.0, 6.0) != draw_delays(3, "export", 4, 10.0, 6.0)
    drawn = draw_delays(3, "train", 40, 10.0, 6.0)
    assert all(not w and 0 <= d <= 10.0 for d, w in drawn[0::2])
    assert all(w and 0 <= d <= 4.0 for d, w in drawn[1::2])


@pytest.mark.parametrize("kind", KINDS)
def test_killed_job_resumes_to_the_uninterrupted_result(harness, kind):
    harness.reference(kind)
    delays = draw_delays(SEED, kind, 2, harness.typical[kind], harness.writing[kind])
    outcomes = [harness.one(kind, i, d, w) for i, (d, w) in enumerate(delays)]
    for o in outcomes:
        assert o.survived, f"{kind} killed at {o.delay}s (replay: python -m eagle3.faults --kinds {kind} " \
                           f"--runs 1 --delay {o.delay}{' --from-write' if o.from_write else ''}): {o.problems}"
    assert f"| {kind} | 2 |" in table(outcomes, SEED, 2)


def test_killed_sglang_client_resumes_to_the_uninterrupted_dataset(harness):
    """The SGLang capture client, its packer and the fake server in one process (tests/faults/sglang_job.py),
    killed once anywhere and once after its first shard, rerun with the same spool: the dataset equals
    the uninterrupted run's tensor for tensor."""
    w = harness.work / "sglang"
    job = lambda name: ["tests/faults/sglang_job.py", str(w / "target"), str(w / f"spool_{name}"), str(w / name)]
    typical, writing = harness.run(job("ref"), "sglang_ref.log", lambda: any((w / "ref.partial").glob("shard-*")))
    for i, (delay, from_write) in enumerate(draw_delays(SEED, "sglang", 2, typical, writing)):
        name = f"killed{i}"
        marker = (lambda: any((w / f"{name}.partial").glob("shard-*"))) if from_write else None
        harness.kill_after(job(name), delay, f"sglang_{name}.log", marker)
        harness.run(job(name), f"sglang_{name}.log")
        assert same_dataset(w / "ref", w / name) == [], f"killed at {delay}s (from its first write: {from_write})"
