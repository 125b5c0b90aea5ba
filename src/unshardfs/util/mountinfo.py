"""The mount table, read without touching a mount, and a mount kept out of its own source.

A FUSE daemon that stats, opens or lists a path on its own mount waits for an
answer only it could give: the request sits in the kernel's queue while the
one thread that would read it is blocked sending it. Everything here learns
about mounts from /proc/self/mountinfo (never by a stat that could cross
into one) and compares directories by (st_dev, st_ino) of file descriptors,
never by path strings: a symlink or a bind mount gives one directory many
names.
"""

from __future__ import annotations

import errno
import os
import select
from dataclasses import dataclass
from typing import Iterator

MOUNTINFO = "/proc/self/mountinfo"
# mountinfo escapes these bytes in paths as a backslash and three octal digits.
_ESCAPES = {"\\040": " ", "\\011": "\t", "\\012": "\n", "\\134": "\\"}
MAX_LINKS = 40  # as the kernel's MAXSYMLINKS


@dataclass(frozen=True)
class MountEntry:
    """One line of mountinfo: where it is mounted, what device, what file system type, from what."""

    target: str
    device: str  # "major:minor"
    fstype: str
    source: str


def _unescape(field: str) -> str:
    if "\\" not in field:
        return field
    for escaped, plain in _ESCAPES.items():
        field = field.replace(escaped, plain)
    return field


def mount_table() -> list[MountEntry]:
    """Every mount this process can see, in mount order (a later entry over the same target hides
    an earlier one)."""
    entries = []
    with open(MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 10:
                continue
            # mount id, parent id, major:minor, root, mount point, options, optional fields up to
            # a "-", then file system type, source, super options (proc(5))
            _id, _parent, device, _root, target, _options, *tagged = fields
            if "-" not in tagged:
                continue
            after = tagged[tagged.index("-") + 1:]
            if len(after) < 2:
                continue
            fstype, source, *_ = after
            entries.append(MountEntry(_unescape(target), device, fstype, _unescape(source)))
    return entries


def mounted_at(target: str) -> MountEntry | None:
    """The mount on `target` (an absolute path without symlinks), the topmost one; None if none."""
    found = None
    for entry in mount_table():
        if entry.target == target:
            found = entry
    return found


def mountpoint_path(path: str) -> str:
    """`path` as the mount table names it: absolute, its symlinks resolved, without ever
    stat'ing its last component when that is a mount point (a stat of a mount whose daemon is
    hung, crashed or ourselves would wait or fail). Symlinks in the last component are read
    with readlink, which never enters a mount; the directories above it are resolved by
    `realpath`. The same at mount and unmount time, so a mount made through a symlink is found
    again by the same name."""
    path = os.path.abspath(path)
    for _ in range(MAX_LINKS):
        try:
            target = os.readlink(path)
        except OSError:  # not a symlink (EINVAL), or missing: resolved as far as it goes
            break
        path = os.path.normpath(os.path.join(os.path.dirname(path), target))
    else:
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
    parent, name = os.path.split(path)
    if not name:  # the root directory
        return path
    return os.path.join(os.path.realpath(parent), name)


def _identities(fd: int) -> Iterator[tuple[int, int]]:
    """(st_dev, st_ino) of the directory `fd` and of each directory above it, up to `/`, going
    up by `..` from the descriptor (so across bind mounts as the kernel does, never by name).
    `fd` is borrowed, not closed."""
    current = os.dup(fd)
    try:
        for _ in range(4096):
            st = os.fstat(current)
            yield st.st_dev, st.st_ino
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=current)
            up = os.fstat(parent)
            os.close(current)
            current = parent
            if (up.st_dev, up.st_ino) == (st.st_dev, st.st_ino):  # `/`: its own parent
                return
    finally:
        os.close(current)


def open_directory(path: str) -> int:
    """An O_PATH descriptor of directory `path` (symlinks followed: the user's own naming)."""
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)


def overlap(mountpoint_fd: int, source_fd: int, whole_tree: bool = True) -> str | None:
    """How a mount on directory `mountpoint_fd` would read itself through a local source rooted
    at directory `source_fd`, or None if it would not.

    'inside': the mountpoint is the source root or lies beneath it (only when the source serves
    its `whole_tree`; an archive's directory reads one file, and a mountpoint beside it is
    fine). 'through': the source root lies beneath the mountpoint, so mounting hides it.
    Decided by device and inode going up from each descriptor, so symlinks and bind mounts of
    either side are seen through."""
    mount_st = os.fstat(mountpoint_fd)
    source_st = os.fstat(source_fd)
    mount_id = (mount_st.st_dev, mount_st.st_ino)
    source_id = (source_st.st_dev, source_st.st_ino)
    if whole_tree and source_id in _identities(mountpoint_fd):
        return "inside"
    if mount_id in _identities(source_fd):
        return "through"
    return None


class OwnMount:
    """Where a daemon's own mount is attached, kept current: the mount points (as the mount
    table names them) of its FUSE connection's device -- the mount itself, and any bind mount
    or propagated copy of it made later. Whatever lies at one of them must never be stat'ed,
    opened or listed by the daemon; the table is read again whenever the kernel says it
    changed (poll on mountinfo), and only then."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._file = open(MOUNTINFO, "rb", buffering=0)
        self._poll = select.poll()
        self._poll.register(self._file.fileno(), select.POLLPRI | select.POLLERR)
        self._poll.poll(0)  # the current table is read below: forget changes before it
        self.generation = 0
        self.targets: frozenset[str] = frozenset()
        self._children: dict[str, frozenset[str]] = {}
        self._read()

    @classmethod
    def of(cls, target: str) -> "OwnMount | None":
        """The mount on `target` (a `mountpoint_path`), or None if nothing is mounted there."""
        entry = mounted_at(target)
        return None if entry is None else cls(entry.device)

    def _read(self) -> None:
        targets = frozenset(e.target for e in mount_table() if e.device == self.device)
        children: dict[str, set[str]] = {}
        for target in targets:
            parent, name = os.path.split(target)
            if name:
                children.setdefault(parent, set()).add(name)
        self.targets = targets
        self._children = {parent: frozenset(names) for parent, names in children.items()}
        self.generation += 1

    def refresh(self) -> bool:
        """Re-read the table if it changed since last read; True if it was re-read."""
        if self._file.closed or not self._poll.poll(0):
            return False
        self._read()
        return True

    def beneath(self, root: str) -> bool:
        """Whether one of the mount points lies strictly beneath directory `root` (a real path)."""
        prefix = root.rstrip("/") + "/"
        return any(t.startswith(prefix) for t in self.targets)

    def names_in(self, directory: str) -> frozenset[str]:
        """The names in `directory` (a real path) that are mount points of ours."""
        return self._children.get(directory, frozenset())

    def hides(self, dir_fd: int, name: str) -> bool:
        """Whether entry `name` of the open directory `dir_fd` is one of the mount points (its
        directory named by the kernel from the descriptor; nothing is stat'ed)."""
        if not self._children:
            return False
        return name in self.names_in(fd_path(dir_fd))

    def close(self) -> None:
        self._file.close()


def fd_path(fd: int) -> str:
    """The path the kernel names an open descriptor by (from its dentry; no lookup is done)."""
    return os.readlink(f"/proc/self/fd/{fd}")
