"""What the chaos run prints: outcomes and stalls per fault, the failures one
by one, and a verdict line.

The stall of a fault is measured on the streams in flight when it struck: for
each, the longest wait between consecutive events of the stream (its start,
each SSE data event, its end); p50 and p99 over those streams. A worker's
SIGKILL should stall its streams at most ``WORKER_STALL_TARGET_S`` at p99.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from bench.chaos_check import Verdict, by_fault
from bench.chaos_faults import Injected
from bench.stats import markdown_table, percentile

__all__ = ["WORKER_STALL_TARGET_S", "Report"]

OUTCOMES = ("answered", "errored", "lost", "duplicated", "corrupted")
WORKER_STALL_TARGET_S = 3.0
_WORKER_FAULTS = ("worker", "worker-redis-down", "redis-flush-worker")


def _s(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"  # NaN: no stream in flight


class Report:
    def __init__(self, verdicts: list[Verdict], injected: Sequence[Injected],
                 unexpected: Sequence[tuple[float, str, int]], skipped: Sequence[str]) -> None:
        self.verdicts = verdicts
        self.injected = list(injected)
        self.unexpected = list(unexpected)
        self.skipped = list(skipped)
        self.groups = by_fault(verdicts, [(e.name, e.injected_at) for e in self.injected])
        self.now = time.monotonic()

    def stalls(self, event: Injected) -> list[float]:
        return [v.record.longest_gap(self.now) for v in self.verdicts
                if v.record.in_flight_at(event.injected_at)]

    def counts(self, verdicts: Sequence[Verdict]) -> Counter[str]:
        return Counter(v.outcome for v in verdicts)

    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.outcome in ("lost", "duplicated", "corrupted")]

    def table(self) -> str:
        header = ["fault", "requests", *OUTCOMES, "in flight", "stall p50 s", "stall p99 s",
                  "stall max s"]
        rows = []
        names = ["baseline", *[e.name for e in self.injected]]
        for name in names:
            group = self.groups.get(name, [])
            c = self.counts(group)
            event = next((e for e in self.injected if e.name == name), None)
            stalls = self.stalls(event) if event is not None else []
            rows.append([name, str(len(group)), *(str(c[o]) for o in OUTCOMES),
                         str(len(stalls)) if event else "-", _s(percentile(stalls, 50)),
                         _s(percentile(stalls, 99)), _s(max(stalls, default=float("nan")))])
        c = self.counts(self.verdicts)
        rows.append(["overall", str(len(self.verdicts)), *(str(c[o]) for o in OUTCOMES),
                     "", "", "", ""])
        return markdown_table(header, rows)

    def worker_stall_p99(self) -> float:
        stalls = [s for e in self.injected if e.name in _WORKER_FAULTS for s in self.stalls(e)]
        return percentile(stalls, 99)

    def calm(self) -> str:
        """Figures of the requests no fault struck while they ran, to read stalls against."""
        calm = [v.record for v in self.verdicts if v.outcome == "answered"
                and not any(v.record.in_flight_at(e.injected_at) for e in self.injected)]
        if not calm:
            return "no request ran without a fault"
        total = [r.ended - r.started for r in calm if r.ended is not None]
        ttft = [r.events[0] - r.started for r in calm if r.events]
        gaps = [r.longest_gap(self.now) for r in calm]
        return (f"requests no fault struck ({len(calm)}): duration p50 "
                f"{_s(percentile(total, 50))} s, TTFT p50 {_s(percentile(ttft, 50))} s, "
                f"longest gap p50 {_s(percentile(gaps, 50))} s, p99 {_s(percentile(gaps, 99))} s")

    def lines(self) -> list[str]:
        out = [self.table(), "", self.calm()]
        for e in self.injected:
            back = f", undone after {e.restored_at - e.injected_at:.1f} s" if e.restored_at else ""
            notes = "; ".join(n for n in e.notes if not n.startswith("killed:"))
            out.append(f"{e.name}: {notes}{back}")
        for name in self.skipped:
            out.append(f"{name}: skipped (time or request limit reached)")
        starts = [(e.injected_at, e.name) for e in self.injected]
        for at, proc, code in self.unexpected:
            during = [n for t, n in starts if t <= at]
            out.append(f"UNEXPECTED EXIT: {proc} exited with code {code} "
                       f"(during {during[-1] if during else 'baseline'}); restarted")
        errors = Counter(f"{v.record.error_kind} {v.record.error_code or ''}".strip()
                         for v in self.verdicts if v.outcome == "errored")
        if errors:
            out.append("errors: " + ", ".join(f"{k} x{n}" for k, n in errors.most_common()))
        unlike = [v for v in self.verdicts if v.unlike_reference]
        if unlike:
            out.append(f"answers unlike their prompt's answer before any fault (greedy; shown, "
                       f"not counted): {len(unlike)}: "
                       + ", ".join(f"{v.record.request_id} (runs "
                                   f"{v.logged.runs() if v.logged else '?'})"
                                   for v in unlike[:10]))
        groups = {id(v): name for name, vs in self.groups.items() for v in vs}
        for v in self.verdicts:
            if v.outcome == "errored":
                r = v.record
                held = "no chunk in the log" if v.logged is None else (
                    f"{len(v.logged.chunks)} chunks in the log, runs {v.logged.runs()}")
                out.append(f"errored [{groups[id(v)]}] request {r.request_id or '?'} "
                           f"(trace {r.trace_id}): {(r.error or '')[:120]}; {held}")
        for v in self.failures():
            r = v.record
            out.append(f"{v.outcome.upper()} [{groups[id(v)]}] request {r.request_id or '?'} "
                       f"(trace {r.trace_id}, client {r.client} #{r.number}): {v.why}")
        return out

    def verdict(self) -> tuple[bool, str]:
        c = self.counts(self.verdicts)
        bad = c["lost"] + c["duplicated"] + c["corrupted"]
        p99 = self.worker_stall_p99()
        stall = ("worker stall p99 -" if p99 != p99 else
                 f"worker stall p99 {p99:.1f} s (target <= {WORKER_STALL_TARGET_S:g} s: "
                 f"{'met' if p99 <= WORKER_STALL_TARGET_S else 'MISSED'})")
        head = "PASS" if bad == 0 else "FAIL"
        return bad == 0, (
            f"chaos verdict: {head}: {len(self.verdicts)} requests, {c['answered']} answered, "
            f"{c['errored']} errored, {c['lost']} lost, {c['duplicated']} duplicated, "
            f"{c['corrupted']} corrupted; {stall}; "
            f"{len(self.unexpected)} unexpected process exits")
