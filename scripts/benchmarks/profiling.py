"""`scripts/bench --profile`: a sampling profile of the daemon (py-spy) for every figure measured.

While `--profile` is on, every unshardfs daemon a scenario mounts (and every
export process and Dask worker of `export-scale`) is sampled by `py-spy
record --nonblocking` from its mount to its unmount. Samples are pooled per
figure (the label a scenario sets with `figure`): each figure gets its
collapsed stacks (`py-spy --format raw`, one "frame;frame;... count" line per
stack, the input of any flame graph tool) and a flame graph SVG drawn from
them, in one directory beside the JSON. Sampling costs the daemon little
(py-spy reads its memory from another process without stopping it), but
figures measured with `--profile` are for finding where the time goes, not
for recording.
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

RATE = 250  # samples per second
PY_SPY = Path(sys.executable).parent / "py-spy"

ACTIVE: "Profiler | None" = None  # set by scripts/bench --profile

# Functions a thread sits in while it waits for work (py-spy cannot tell an idle thread here from
# a busy one: it samples both): a sample whose innermost frame is one of them is idle.
IDLE = ("EpollIOManager.get_events (trio/_core/_io_epoll.py)", "EpollSelector.select (selectors.py)",
        "WorkerThread._work (trio/_core/_thread_cache.py)", "Condition.wait (threading.py)",
        "Event.wait (threading.py)", "Thread._wait_for_tstate_lock (threading.py)",
        "select (selectors.py)", "poll (selectors.py)")


def busy(stacks: Counter[str]) -> Counter[str]:
    """The samples of `stacks` whose thread was working, not waiting (see IDLE)."""
    return Counter({stack: k for stack, k in stacks.items() if where(stack.rsplit(";", 1)[-1]) not in IDLE})


class Recording:
    def __init__(self, proc: subprocess.Popen[bytes], out: Path, label: str) -> None:
        self.proc, self.out, self.label = proc, out, label


class Profiler:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.label = "unlabelled"
        self.stacks: dict[str, Counter[str]] = {}
        self.failures: list[str] = []
        self._n = 0

    def attach(self, pid: int) -> Recording | None:
        """py-spy sampling `pid` until it exits (or `stop`); None if it could not attach (said once)."""
        if not PY_SPY.exists():
            self._failed(f"py-spy is not installed in {PY_SPY.parent} (scripts/bench installs it)")
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        self._n += 1
        out = self.directory / f".sample-{self._n}.txt"
        proc = subprocess.Popen([str(PY_SPY), "record", "--pid", str(pid), "--rate", str(RATE), "--nonblocking",
                                 "--format", "raw", "--output", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        # Ready once it says it is sampling (on stdout): samples before that would be lost to the figure.
        assert proc.stdout is not None
        said = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and b"Sampling process" not in said:
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 4096)
                if not chunk:
                    break
                said += chunk
        if b"Sampling process" not in said:
            proc.kill()
            proc.wait()
            lines = [ln for ln in said.decode(errors="replace").splitlines() if ln.strip()]
            self._failed(f"py-spy could not attach to the daemon ({lines[-1] if lines else 'no answer'}); "
                         "it needs ptrace (root, or kernel.yama.ptrace_scope 0)")
            return None
        return Recording(proc, out, self.label)

    def stop(self, recording: Recording | None, timeout: float = 30) -> None:
        """Wait for py-spy to see its process gone and write its samples (interrupted after `timeout`)."""
        if recording is None:
            return
        proc = recording.proc
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # py-spy writes what it has on ^C
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if recording.out.exists():
            pooled = self.stacks.setdefault(recording.label, Counter())
            for line in recording.out.read_text().splitlines():
                stack, _, count = line.rpartition(" ")
                if stack and count.isdigit():
                    pooled[stack] += int(count)
            recording.out.unlink()

    def _failed(self, why: str) -> None:
        if why not in self.failures:
            self.failures.append(why)
            print(why, file=sys.stderr, flush=True)

    def write(self) -> dict[str, object]:
        """Each figure's raw stacks and flame graph; what the report says of them."""
        summary: dict[str, object] = {}
        for label, stacks in self.stacks.items():
            working = busy(stacks)
            if not working:
                continue
            name = slug(label)
            raw = self.directory / f"{name}.txt"
            raw.write_text("".join(f"{stack} {n}\n" for stack, n in sorted(stacks.items())))
            svg = self.directory / f"{name}.svg"
            svg.write_text(flame_svg(working, f"{label} (working samples)"))
            total = sum(stacks.values())
            summary[label] = {"samples": total, "idle_share": round(1 - sum(working.values()) / total, 3),
                              "svg": svg.name, "raw": raw.name, "top_self": top(working),
                              "by_module": by_module(working)}
        return summary


@contextlib.contextmanager
def figure(label: str) -> Iterator[None]:
    """Samples taken inside go to `label`'s profile."""
    if ACTIVE is None:
        yield
        return
    before, ACTIVE.label = ACTIVE.label, label
    try:
        yield
    finally:
        ACTIVE.label = before


def attach(pid: int) -> Recording | None:
    return ACTIVE.attach(pid) if ACTIVE is not None else None


def stop(recording: Recording | None) -> None:
    if ACTIVE is not None:
        ACTIVE.stop(recording)


def slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-").lower()[:80] or "profile"


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def where(frame: str) -> str:
    """`function (path/to/module.py)` without its line: one name per function."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m["file"]
    for marker in ("/site-packages/", "/src/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{m['func']} ({path})"


def top(stacks: Counter[str], n: int = 12) -> list[list[object]]:
    """The functions with the most samples at the top of the stack: [function, share of samples]."""
    counts: Counter[str] = Counter()
    total = sum(stacks.values())
    for stack, k in stacks.items():
        counts[where(stack.rsplit(";", 1)[-1])] += k
    return [[f, round(k / total, 3)] for f, k in counts.most_common(n)]


def by_module(stacks: Counter[str], n: int = 15) -> list[list[object]]:
    """unshardfs's modules by the share of samples with one of their functions anywhere on the
    stack (what a module costs with everything it calls): [module, share of samples]. The entry
    point's modules (`__main__`, `app/`), on every stack, are left out."""
    counts: Counter[str] = Counter()
    total = sum(stacks.values())
    for stack, k in stacks.items():
        modules = set()
        for frame in stack.split(";"):
            m = _FRAME.match(frame)
            if m and "unshardfs/" in m["file"]:
                module = m["file"].split("unshardfs/", 1)[1]
                if module != "__main__.py" and not module.startswith("app/"):
                    modules.add(module)
        for module in modules:
            counts[module] += k
    return [[f, round(k / total, 3)] for f, k in counts.most_common(n)]


def flame_svg(stacks: Counter[str], title: str, width: int = 1200, row: int = 16) -> str:
    """A flame graph (callers below, callees above, width by samples) as a standalone SVG."""
    tree: dict[str, Frame] = {}
    for stack, k in stacks.items():
        level = tree
        for f in stack.split(";"):
            node = level.setdefault(f, Frame())
            node.samples += k
            level = node.children
    total = sum(stacks.values())
    depth = max(len(stack.split(";")) for stack in stacks)
    height = (depth + 1) * row + 24
    rects: list[str] = []

    def draw(level: dict[str, Frame], x: float, d: int) -> None:
        y = height - (d + 1) * row
        for name, node in sorted(level.items()):
            w = node.samples / total * width
            if w >= 0.3:
                label = html.escape(where(name))
                fits = int(w / 7)
                text = label if fits >= len(label) else (label[: fits - 2] + ".." if fits > 3 else "")
                hue = 10 + sum(map(ord, name.split(" ")[0])) % 45
                rects.append(f'<g><title>{label}: {node.samples} samples ({node.samples / total:.1%})</title>'
                             f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 1}" '
                             f'fill="hsl({hue},85%,62%)"/><text x="{x + 2:.1f}" y="{y + row - 4}">{text}</text></g>')
                draw(node.children, x, d + 1)
            x += w

    draw(tree, 0.0, 0)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="monospace" font-size="11">\n'
            f'<text x="4" y="16" font-size="14">{html.escape(title)}: {total} samples (py-spy)</text>\n'
            + "\n".join(rects) + "\n</svg>\n")


class Frame:
    __slots__ = ("samples", "children")

    def __init__(self) -> None:
        self.samples = 0
        self.children: dict[str, Frame] = {}
