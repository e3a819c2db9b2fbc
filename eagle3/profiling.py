"""train.profile_steps=[FIRST,LAST]: torch.profiler over those training steps, written to
RUN_DIR/profile/ by the main process:

    trace.json     the Chrome trace (chrome://tracing or https://ui.perfetto.dev)
    ops.txt        the operators by their own device time (on a GPU), then by their own host time
    summary.json   wall time of the steps and, on a GPU, how much of it some kernel ran:
                   gpu_busy_share near 1 means the GPU is the limit; well below it, the GPU waits
                   for the host (launch overhead, host-side data work, a wait for a device value).
                   host_ms_per_step: the host's time in each phase of a step (data: batches, their
                   teachers and counted rows; forward; backward; optimizer), wait_ms_per_step: its
                   time blocked in CUDA synchronisation calls, by call, and launches_per_step: the
                   kernels it queued. A phase whose host time exceeds the GPU's work in it, or a
                   large wait followed by an idle GPU, is where to look.

    python train.py +experiment=kimi_k25 train.profile_steps=[20,22]

The steps before FIRST run unprofiled (the one just before is the profiler's warm-up), and the
profiler costs some speed itself, so the rates logged for these steps are not the run's.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import List, Optional, Sequence

import torch


class StepProfiler:
    """start() before the loop, step() after each step, stop() after the loop; inert without steps."""

    def __init__(self, steps: Optional[Sequence[int]], start: int, out_dir: Path, device: torch.device,
                 enabled: bool = True):
        self.prof, self.out_dir, self.cuda = None, Path(out_dir), device.type == "cuda"
        self.t0 = self.wall = None                # perf_counter at the first profiled step; its steps' seconds
        if not enabled or not steps:
            return
        if len(steps) != 2 or steps[0] > steps[1] or steps[0] < 0:
            raise ValueError(f"train.profile_steps={list(steps)}: expected [first, last] with 0 <= first <= last")
        first, last = int(steps[0]), int(steps[1])
        if last < start:
            print(f"[train] train.profile_steps={list(steps)} lie before this run's first step {start}: not profiled")
            return
        first = max(first, start)
        from torch.profiler import ProfilerActivity, profile, schedule

        warmup = 1 if first > start else 0
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.first, self.last = first, last
        self.prof = profile(activities=activities, on_trace_ready=self._write,
                            schedule=schedule(skip_first=first - start - warmup, wait=0, warmup=warmup,
                                              active=last - first + 1, repeat=1))
        self.step_no = start

    def start(self) -> None:
        if self.prof is not None:
            self.prof.start()
            if self.step_no == self.first:
                self.t0 = time.perf_counter()

    def step(self) -> None:
        if self.prof is None:
            return
        if self.cuda and self.step_no in (self.first - 1, self.last):
            torch.cuda.synchronize()          # the steps' wall time spans their kernels
        self.step_no += 1
        if self.step_no == self.first:
            self.t0 = time.perf_counter()
        elif self.step_no == self.last + 1:
            self.wall = time.perf_counter() - self.t0
        self.prof.step()

    def stop(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None

    def _write(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / "trace.json"
        prof.export_chrome_trace(str(trace))
        ops = prof.key_averages()
        tables = ([ops.table(sort_by="self_device_time_total", row_limit=50)] if self.cuda else []) + \
            [ops.table(sort_by="self_cpu_time_total", row_limit=50)]
        (self.out_dir / "ops.txt").write_text("\n\n".join(tables) + "\n")
        steps = self.last - self.first + 1
        summary = {"steps": [self.first, self.last], "wall_s": self.wall}
        events = json.loads(trace.read_text()).get("traceEvents", [])
        if self.cuda:
            busy = busy_seconds(events)
            summary.update(gpu_busy_s=busy, gpu_busy_share=busy / summary["wall_s"] if summary["wall_s"] else None)
        if summary["wall_s"]:
            summary["ms_per_step"] = 1000 * summary["wall_s"] / steps
        summary.update(host_summary(events, steps))
        (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"[train] profile of steps {self.first}-{self.last}: {self.out_dir} {json.dumps(summary)}", flush=True)


def covered_us(events: List[dict]) -> float:
    """Microseconds covered by the union of complete events' [ts, ts + dur] intervals: overlapping
    and nested events count once."""
    total, end = 0.0, -float("inf")
    for a, b in sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events):
        if b > end:
            total, end = total + b - max(a, end), b
    return total


def busy_seconds(events: List[dict]) -> float:
    """Seconds during which at least one GPU kernel or copy ran: the union of their intervals."""
    return covered_us([e for e in events if e.get("ph") == "X"
                       and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]) / 1e6


PHASES = ("data", "forward", "backward", "optimizer")
# CUDA runtime calls in which the host blocks until the device has run what was queued before them
WAITS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "cudaStreamWaitEvent")


def phase(name: str):
    """A named span of a training step (one of PHASES) in the profiler's trace; inert without a profiler."""
    return torch.profiler.record_function(f"train/{name}")


def host_summary(events: List[dict], steps: int) -> dict:
    """Per step, from a Chrome trace's events: the host's milliseconds in each phase (the union of
    its spans, so nested spans count once), in each blocking CUDA call, and the kernels it launched."""
    def ms(chosen):
        return round(covered_us(chosen) / 1e3 / max(steps, 1), 3)

    cpu = [e for e in events if e.get("ph") == "X"]
    host = {p: ms([e for e in cpu if e.get("cat") == "user_annotation" and e.get("name") == f"train/{p}"])
            for p in PHASES}
    runtime = [e for e in cpu if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    waits = {w: ms([e for e in runtime if e.get("name") == w]) for w in WAITS}
    launches = sum("LaunchKernel" in e.get("name", "") for e in runtime)
    return {"host_ms_per_step": host, "wait_ms_per_step": {w: v for w, v in waits.items() if v},
            "launches_per_step": round(launches / max(steps, 1), 1)}
