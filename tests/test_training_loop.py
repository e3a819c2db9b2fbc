"""The training loop's own arithmetic, checked by hand without running train.py: the ETA, a step's
statistics over its micro-batches, the non-finite check, and the profile's summaries of a trace."""
import pytest
import torch


def test_eta_is_the_recent_mean_step_time_times_the_steps_left():
    """eta_seconds over the loop's window of (step, end time) points equals the steps left times the
    mean of the last RATE_WINDOW step durations, computed here from the durations alone; resuming at
    step 40 counts from the resumed loop's start."""
    from collections import deque
    from eagle3.training import RATE_WINDOW, duration, eta_seconds

    for start, total in ((0, 200), (40, 130)):
        durations = [0.5 + (k % 7) * 0.25 + (3.0 if k % 25 == 0 else 0) for k in range(total - start)]
        now = 1000.0
        recent = deque([(start - 1, now)], maxlen=RATE_WINDOW + 1)
        for k, step in enumerate(range(start, total)):
            now += durations[k]
            recent.append((step, now))
            window = durations[max(0, k + 1 - RATE_WINDOW):k + 1]
            expected = (total - 1 - step) * sum(window) / len(window)
            assert eta_seconds(recent, step, total) == pytest.approx(expected, rel=1e-9), step
    assert [duration(s) for s in (0, 42.4, 200, 3599.6, 3720, 86400 + 61)] == [
        "0s", "42s", "3m20s", "1h00m", "1h02m", "24h01m"]


def test_step_stats_sum_micro_batches_like_the_hand_computed_shares():
    """StepStats keeps its sums on the device; reduce() gives the mean loss over global batches,
    per-step accuracy (correct / count summed over micro-batches, not a mean of ratios) and
    acceptance over all chains, as computed here by hand."""
    from types import SimpleNamespace

    from eagle3.loss import TTTOutput
    from eagle3.training import StepStats

    outs = [TTTOutput(torch.tensor(1.5), torch.zeros(3), torch.tensor([3, 2, 1]), torch.tensor([4, 4, 2]),
                      torch.tensor([3, 1, 0]), torch.tensor(5)),
            TTTOutput(torch.tensor(0.25), torch.zeros(3), torch.tensor([1, 1, 1]), torch.tensor([2, 2, 4]),
                      torch.tensor([2, 2, 1]), torch.tensor(3))]
    stats = StepStats(3)
    for o in outs:
        stats.add(o)
    acc = SimpleNamespace(device=torch.device("cpu"), reduce=lambda t, reduction: t)
    row = stats.reduce(acc, batches=2)
    assert row["loss"] == pytest.approx((1.5 + 0.25) / 2)
    assert row["acc"] == pytest.approx([4 / 6, 3 / 6, 2 / 6])
    assert row["accept"] == pytest.approx([5 / 8, 3 / 8, 1 / 8]) and row["tokens"] == 6
    assert row["tau3"] == pytest.approx(1 + 9 / 8)


def test_a_non_finite_micro_batch_is_named_before_the_optimizer_steps(tmp_path):
    """The loop checks its micro-batch losses once a step; the error names the first non-finite one's samples."""
    from eagle3.training import stop_if_not_finite

    finite = [torch.tensor(0.5), torch.tensor(0.25)]
    stop_if_not_finite(finite, [["a"], ["b"]], 3, tmp_path)                    # nothing to stop
    with pytest.raises(SystemExit, match=r"non-finite loss inf at step 3 on samples \['c', 'd'\]"):
        stop_if_not_finite([*finite, torch.tensor(float("inf")), torch.tensor(float("nan"))],
                                 [["a"], ["b"], ["c", "d"], ["e"]], 3, tmp_path)


def test_busy_seconds_is_the_union_of_kernel_intervals():
    """Overlapping kernels count once, gaps not at all; CPU events are not GPU work (by hand: kernels
    over [0, 10] and [5, 12] and [20, 25] us, a copy over [30, 31]: 12 + 5 + 1 = 18 us)."""
    from eagle3.profiling import busy_seconds

    ev = [{"ph": "X", "cat": "kernel", "ts": 5, "dur": 7}, {"ph": "X", "cat": "kernel", "ts": 0, "dur": 10},
          {"ph": "X", "cat": "kernel", "ts": 20, "dur": 5}, {"ph": "X", "cat": "gpu_memcpy", "ts": 30, "dur": 1},
          {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 100}, {"ph": "X", "cat": "kernel", "ts": 21, "dur": 2}]
    assert busy_seconds(ev) == pytest.approx(18e-6)


def test_host_summary_counts_each_phase_and_wait_once_per_step():
    """By hand, over 2 steps: forward spans [0, 4] ms and [2, 6] ms (nested: 6 ms) and [10, 12] ms;
    data [20, 21] ms; a stream sync of 3 ms twice; three launches. Per step: forward 4, data 0.5,
    waits 3, launches 1.5; GPU-side annotations and other phases' names do not count."""
    from eagle3.profiling import host_summary

    def x(name, cat, a, b):
        return {"ph": "X", "cat": cat, "name": name, "ts": a * 1e3, "dur": (b - a) * 1e3}

    ev = [x("train/forward", "user_annotation", 0, 4), x("train/forward", "user_annotation", 2, 6),
          x("train/forward", "user_annotation", 10, 12), x("train/data", "user_annotation", 20, 21),
          x("train/forward", "gpu_user_annotation", 0, 50), x("train/other", "user_annotation", 0, 9),
          x("cudaStreamSynchronize", "cuda_runtime", 30, 33), x("cudaStreamSynchronize", "cuda_runtime", 40, 43),
          x("cudaLaunchKernel", "cuda_runtime", 1, 1.01), x("cudaLaunchKernel", "cuda_runtime", 2, 2.01),
          x("cuLaunchKernelEx", "cuda_driver", 3, 3.01), x("aten::mm", "cpu_op", 0, 99)]
    got = host_summary(ev, steps=2)
    assert got["host_ms_per_step"] == {"data": 0.5, "forward": 4.0, "backward": 0.0, "optimizer": 0.0}
    assert got["wait_ms_per_step"] == {"cudaStreamSynchronize": 3.0}
    assert got["launches_per_step"] == 1.5
