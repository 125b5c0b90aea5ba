"""Hostile file systems for the tests: paths swapped for links and FIFOs while they are used, and
checksums of witness trees that nothing may change."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from pathlib import Path

OUTSIDE_MARK = b"OUTSIDE-THE-SOURCE"


def checksums(root: Path, skip: Path | None = None) -> dict[str, str]:
    """Every file and link below `root` (links by target, never followed), except below `skip`."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            if skip is not None and (path == skip or skip in path.parents):
                continue
            if path.is_symlink():
                found[str(path)] = "link:" + os.readlink(path)
            elif path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def outside_twin(like: Path, outside: Path) -> None:
    """A directory outside the source holding `like`'s names (and one more) with marked content:
    a byte of it served or a name of it listed is an escape."""
    outside.mkdir(parents=True)
    for name in os.listdir(like):
        (outside / name).write_bytes(OUTSIDE_MARK * 8)
    (outside / "secret-outside").write_bytes(OUTSIDE_MARK)


class Swapper:
    """Swaps each target, as fast as it can, between itself, a symlink to `outside` and a FIFO.

    The real thing is renamed aside (next to it, so still inside the source)
    and back; every state is a plain rename, symlink or mkfifo, as an attacker
    with write access to the directory would do it.
    """

    def __init__(self, targets: list[Path], outside: Path) -> None:
        self.targets = targets
        self.outside = outside
        self.cycles = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for target in self.targets:
                aside = target.with_name(target.name + ".aside")
                try:
                    os.rename(target, aside)
                except OSError:
                    continue
                link_to = self.outside / target.name if (self.outside / target.name).exists() else self.outside
                for make in (lambda: os.symlink(link_to, target), lambda: os.symlink(self.outside, target),
                             lambda: os.mkfifo(target)):
                    # Another actor (export making the directory again) may win the name meanwhile.
                    with contextlib.suppress(OSError):
                        make()
                        os.unlink(target)
                try:
                    os.rename(aside, target)
                except OSError:  # recreated meanwhile: the copy aside goes
                    shutil.rmtree(aside, ignore_errors=True)
                    with contextlib.suppress(OSError):
                        os.unlink(aside)
            self.cycles += 1

    def __enter__(self) -> "Swapper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
