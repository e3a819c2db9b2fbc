"""The CI subset of `python -m eagle3.faults`: each job kind (the SGLang client and its packer among
them) runs once and is killed twice: the first kill drawn over the whole job, the second, on the
resumed attempt, counted from that attempt's first write (so it lands in the work, not the imports);
then it is resumed and compared with its uninterrupted run. A few minutes on 2 CPU cores; the large
counts, each run in one of the two ways, go through the command (docs/reliability.md).

Run: .venv/bin/python -m pytest tests/faults/test_faults_kills.py -q
"""
import json

import pytest

from eagle3.faults import Harness, Job, Outcome, default_kinds, draw_delays, main, replay_command, table

SEED, KILLS = 0, 2
MODES = [False, True]        # the first kill from the job's start, the second from the resumed attempt's first write


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return Harness(tmp_path_factory.mktemp("faults"))


def test_delays_are_seeded_per_kind_so_a_failure_replays():
    assert draw_delays(3, "train", 4, 2) == draw_delays(3, "train", 4, 2)
    assert draw_delays(3, "train", 4, 2) != draw_delays(3, "export", 4, 2)
    drawn = draw_delays(3, "train", 40, 3)
    assert all(len(d) == 3 and all(0 <= x < 1 for x in d) for d, _ in drawn)
    assert [w for _, w in drawn] == [False, True] * 20


def test_a_kill_after_the_job_ended_shortens_the_span_of_later_runs(tmp_path):
    """Delays scale with the job's time; when the machine gets faster and a first attempt ends before
    its kill, later runs draw within that attempt's time, not the slower reference's."""
    h = Harness(tmp_path)
    h.typical["export"], h.writing["export"] = 60.0, 50.0
    assert (h.span("export", False), h.span("export", True)) == (60.0, 10.0)
    h.job = lambda kind, d: Job(["-c", "pass"], ["-c", "pass"], d, lambda: False, lambda: ([], 0))
    o = h.one("export", 0, [0.9, 0.5])
    assert o.kills == 0 and o.delays == [54.0] and o.survived
    assert h.span("export", False) < 10.0 and h.span("export", True) == 10.0


def test_each_kill_counts_its_delay_from_its_own_start_and_the_replay_repeats_it(tmp_path):
    """Per-kill modes: each delay scales with its own span (the whole job's, or from the first
    write's), only a from-write kill waits for the write, and the replay command says which."""
    h = Harness(tmp_path)
    h.typical["export"], h.writing["export"] = 60.0, 50.0
    h.job = lambda kind, d: Job(["-c", "pass"], ["-c", "pass"], d, lambda: False, lambda: ([], 0))
    calls = []
    h.kill_after = lambda args, delay, log, watch: (calls.append((delay, watch)), (True, delay))[1]
    o = h.one("export", 0, [0.5, 0.25], [False, True])
    assert calls == [(30.0, None), (2.5, tmp_path / "export_0000")]
    assert (o.kills, o.delays, o.from_write, o.survived) == (2, [30.0, 2.5], [False, True], True)
    assert replay_command(o) == "python -m eagle3.faults --kinds export --runs 1 --delay 30.0 2.5 --from-write 0 1"
    o.delays = [30.0]                                   # a run whose first attempt ended before its kill
    assert replay_command(o).endswith("--delay 30.0 --from-write 0")
    o.delays, o.from_write = [30.0, 2.5], True
    assert replay_command(o).endswith("--delay 30.0 2.5 --from-write")
    o.from_write = False
    assert replay_command(o).endswith("--delay 30.0 2.5")
    with pytest.raises(ValueError, match="2 delays but 1 from-write modes"):
        h.one("export", 1, [0.5, 0.25], [True])
    with pytest.raises(SystemExit):                     # one mode per delay, or none
        main(["--kinds", "export", "--delay", "1", "2", "--from-write", "1"])


def test_the_table_counts_kills_and_the_units_lost():
    rows = [Outcome("train", 0, [1.0, 2.0], False, kills=2, after_commit=1, survived=True),
            Outcome("train", 1, [1.0, 9.0], True, kills=1, after_commit=1, survived=False, lost=3)]
    rows = [Outcome(**json.loads(json.dumps(o.__dict__))) for o in rows]      # as results.jsonl holds them
    text = table(rows, 7, 2)
    assert "| train | 2 | 3 | 2 | 1 | 3 steps | `python -m eagle3.faults --kinds train --runs 2 --kills 2 --seed 7` |" in text
    assert "| all | 2 | 3 | 2 | 1 | 1 runs | |" in text


@pytest.mark.parametrize("kind", default_kinds())
def test_killed_job_resumes_to_the_uninterrupted_result(harness, kind):
    harness.reference(kind)
    outcomes = [harness.one(kind, 0, draw_delays(SEED, kind, 1, KILLS)[0][0], MODES)]
    # a reference timed on a busier machine can put every kill past the job's end; each miss shortens
    # the span (the harness learns the job's time), so a few more runs find it running
    for extra in range(3):
        if sum(o.kills for o in outcomes):
            break
        d, _ = draw_delays(SEED + 1 + extra, kind, 1, KILLS)[0]
        outcomes.append(harness.one(kind, len(outcomes), d, MODES))
    for o in outcomes:
        assert o.survived, f"{kind} killed at {o.delays}s (replay: {replay_command(o)}): {o.problems}"
    assert sum(o.kills for o in outcomes) >= 1, f"no kill of {kind} found it running: {outcomes}"
    assert f"| {kind} | {len(outcomes)} |" in table(outcomes, SEED, KILLS)
