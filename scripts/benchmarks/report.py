"""One reporter for every scenario: figures next to same-run baselines, printed and saved as JSON."""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Row:
    metric: str
    ours: float
    unit: str
    baseline_name: str
    baseline: float
    target: str = ""
    # What bounds the figure, for ours and the baseline (`measure.Measured.detail`): wall time,
    # CPU seconds of the daemon, store and readers, the store's requests and round trips.
    detail: dict[str, Any] | None = None

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else float("nan")


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    facts: dict[str, object] = field(default_factory=dict[str, Any])  # figures without a baseline (counts, memory)
    notes: list[str] = field(default_factory=list)  # lines printed after the facts (where profiles went)

    def row(self, metric: str, ours: float, unit: str, baseline_name: str, baseline: float,
            target: str = "", detail: dict[str, Any] | None = None) -> None:
        self.rows.append(Row(metric, ours, unit, baseline_name, baseline, target, detail))

    def fact(self, name: str, value: object) -> None:
        self.facts[name] = value

    def note(self, line: str) -> None:
        self.notes.append(line)

    def machine(self) -> dict[str, object]:
        return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}

    def print(self) -> None:
        m = self.machine()
        print(f"\nunshardfs benchmark - {m['cpus']} CPUs, Linux {m['kernel']}, Python {m['python']}\n")
        print(f"{'metric':40} {'unshardfs':>16}  {'ratio':>6}  {'baseline':36} {'baseline value':>14}  target")
        for r in self.rows:
            print(f"{r.metric:40} {f'{r.ours:,.1f} {r.unit}':>16}  {r.ratio:6.2f}  {r.baseline_name:36} "
                  f"{r.baseline:14,.1f}  {r.target}")
            for side in ("ours", "baseline"):
                if r.detail and r.detail.get(side):
                    print(f"    {side + ':':10} {describe(r.detail[side])}")
        print()
        for name, value in self.facts.items():
            print(f"{name}: {json.dumps(value, default=str)}")
        for line in self.notes:
            print(line)

    def save(self, path: Path) -> None:
        rows = [{**r.__dict__, "ratio": r.ratio} for r in self.rows]
        path.write_text(json.dumps({"machine": self.machine(), "rows": rows, "facts": self.facts},
                                   indent=2, default=str))


def describe(d: dict[str, Any]) -> str:
    """One line of a row's detail: wall time, CPU seconds by process, the store's counts."""
    parts = [f"{d['seconds']:.3f} s"]
    cpu = [f"{who} {d[key]:.2f}" + (f" ({d['daemon_cpu_us_per_file']:,} us/file)" if who == "daemon" else "")
           for who, key in (("daemon", "daemon_cpu_s"), ("store", "store_cpu_s"), ("readers", "readers_cpu_s"),
                            ("client", "client_cpu_s"), ("workers", "workers_cpu_s"),
                            ("scheduler", "scheduler_cpu_s")) if key in d]
    if cpu:
        parts.append("CPU s: " + ", ".join(cpu))
    if "requests" in d:
        parts.append(f"{d['requests']} requests, {d.get('round_trips', '?')} round trips")
    if d.get("prefetched_bytes"):
        parts.append(f"prefetched {d['prefetched_bytes'] / 2**20:.1f} MiB ({d.get('wasted_bytes', 0) / 2**20:.1f} wasted)")
    return "; ".join(parts)
