"""Projected single-stream tok/s of a drafter: measured acceptance x measured draft-step latency,
against a production baseline. A projection, not a measurement: the verify cost is an assumption.

    python -m eagle3.projection --report runs/kimi_k25/eval/report.json --draft-ms 1.2 --baseline-tok-s 90
    python -m eagle3.projection --accept 0.8 0.62 0.48 --draft-ms 1.2 --baseline-tok-s 90 [--verify-factor 1.3]

One speculative cycle at batch 1, a chain of k draft tokens (topk 1):

    tau = 1 + sum_i a_i                  a_i: share of cycles whose i-th draft token is accepted
                                         (report.json's accept_per_position), + 1 bonus token
    T   = k * t_draft + c * t_target     t_target = 1 / baseline tok/s (one plain decode step)
    projected tok/s = tau / T

k draft forwards per cycle: SGLang's EAGLE worker runs the drafter once over the tokens just
accepted (draft extend, which drafts the first token) and k - 1 times more along the chain.
c (verify_factor) is what verifying k + 1 tokens costs against one decode step: about 1 where a
decode step is memory-bound (a large target on GPUs), more where it is compute-bound (a CPU) or
where the k + 1 tokens read more MoE experts than one token does. docs/perf.md, "Projected speed",
gives the inputs and checks the formula against vLLM runs measured end to end.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import List, Sequence


def project(accept_per_position: Sequence[float], draft_ms: float, baseline_tok_s: float,
            verify_factor: float = 1.0) -> dict:
    """The projection for one drafter; k = len(accept_per_position)."""
    k = len(accept_per_position)
    if k < 1 or baseline_tok_s <= 0 or draft_ms < 0 or verify_factor <= 0:
        raise ValueError(f"need >= 1 acceptance rate, baseline tok/s > 0, draft ms >= 0, verify factor > 0; got "
                         f"{list(accept_per_position)}, {baseline_tok_s}, {draft_ms}, {verify_factor}")
    tau = 1.0 + sum(accept_per_position)
    target_ms = 1000.0 / baseline_tok_s
    cycle_ms = k * draft_ms + verify_factor * target_ms
    tok_s = 1000.0 * tau / cycle_ms
    return {"tau": tau, "num_steps": k, "draft_ms": draft_ms, "target_ms": target_ms,
            "verify_factor": verify_factor, "cycle_ms": cycle_ms,
            "projected_tok_s": tok_s, "projected_speedup": tok_s / baseline_tok_s}


def cycle_factor(baseline_tok_s: float, untrained_tok_s: float) -> float:
    """(k * t_draft + c * t_target) / t_target, read off a run where nothing is accepted (tau = 1):
    each cycle then yields one token, so the cycle takes 1 / untrained tok/s."""
    return baseline_tok_s / untrained_tok_s


def project_with_factor(accept_per_position: Sequence[float], baseline_tok_s: float, factor: float) -> float:
    """Projected tok/s when the whole cycle cost is known as a multiple of one decode step."""
    return (1.0 + sum(accept_per_position)) * baseline_tok_s / factor


def describe(p: dict, name: str = "") -> str:
    return (f"{name + ': ' if name else ''}projected {p['projected_tok_s']:.1f} tok/s "
            f"({p['projected_speedup']:.2f}x the baseline's {1000.0 / p['target_ms']:.1f}) from tau {p['tau']:.2f}; "
            f"cycle {p['num_steps']} x {p['draft_ms']:.2f} ms draft + {p['verify_factor']:g} x "
            f"{p['target_ms']:.2f} ms verify (assumed) = {p['cycle_ms']:.2f} ms")


def markdown_section(rows: Sequence[dict], draft_ms: float, baseline_tok_s: float, verify_factor: float) -> str:
    """The evaluation report's "Projected" table: rows are report.json's results."""
    lines = ["", f"## Projected single-stream speed at the production baseline ({baseline_tok_s:g} tok/s)", "",
             f"Not measured: eagle3/projection.py from each row's acceptance per position, a draft step of "
             f"{draft_ms:g} ms and a verify of {verify_factor:g} x one decode step (assumed).", "",
             "| drafter | prompts | chain | tau | projected tok/s | projected speedup |", "|---|---|---|---|---|---|"]
    for r in rows:
        p = project(r["accept_per_position"], draft_ms, baseline_tok_s, verify_factor)
        lines.append(f"| {r['drafter']} | {r['prompts']} | {p['num_steps']} | {p['tau']:.2f} | "
                     f"{p['projected_tok_s']:.1f} | {p['projected_speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--report", type=Path, help="an evaluation's report.json: every row is projected")
    src.add_argument("--accept", type=float, nargs="+", help="acceptance per draft position")
    ap.add_argument("--draft-ms", type=float, required=True, help="one draft step at batch 1 (bench/draft_latency.py)")
    ap.add_argument("--baseline-tok-s", type=float, default=None,
                    help="single-stream tok/s without a drafter (default: the report's production figure)")
    ap.add_argument("--verify-factor", type=float, default=1.0, help="verify of k+1 tokens / one decode step")
    a = ap.parse_args(argv)
    if a.accept:
        if a.baseline_tok_s is None:
            sys.exit("error: --accept needs --baseline-tok-s")
        print(describe(project(a.accept, a.draft_ms, a.baseline_tok_s, a.verify_factor)))
        return
    report = json.loads(a.report.read_text())
    base = a.baseline_tok_s or report.get("production_baseline_tok_s")
    if not base:
        sys.exit("error: the report has no production_baseline_tok_s; pass --baseline-tok-s")
    for r in report["results"]:
        p = project(r["accept_per_position"], a.draft_ms, base, a.verify_factor)
        print(describe(p, f"{r['drafter']} / {r['prompts']} / chain {r.get('num_steps') or len(r['accept_per_position'])}"))


if __name__ == "__main__":
    main()
