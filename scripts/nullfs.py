"""The benchmark's ceiling: a pyfuse3 file system serving files from memory.

It does no format work at all: one flat table name -> bytes per directory,
the same kernel-cache settings as unshardfs (long timeouts, keep_cache,
cached negative lookups). Whatever unshardfs costs beyond this is ours.

Usage: nullfs.py SOURCE_DIR MOUNTPOINT          mirror a directory tree (loaded into memory)
       nullfs.py --flat NAMES_FILE MOUNTPOINT   one directory of 1-byte files named by the lines
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import sys

import pyfuse3
import trio

TIMEOUT = 3600.0


class NullFS(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[str, int]] = []  # ino -> (name, parent) is not needed
        self.children: dict[int, dict[bytes, int]] = {pyfuse3.ROOT_INODE: {}}
        self.order: dict[int, list[bytes]] = {pyfuse3.ROOT_INODE: []}
        self.data: dict[int, bytes] = {}
        self.next_ino = pyfuse3.ROOT_INODE + 1

    def add(self, parent: int, name: str, data: bytes | None) -> int:
        ino = self.next_ino
        self.next_ino += 1
        self.children[parent][os.fsencode(name)] = ino
        self.order[parent].append(os.fsencode(name))
        if data is None:
            self.children[ino] = {}
            self.order[ino] = []
        else:
            self.data[ino] = data
        return ino

    def attr(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = a.attr_timeout = TIMEOUT
        if ino in self.children:
            a.st_mode, a.st_size = stat.S_IFDIR | 0o555, 0
        else:
            a.st_mode, a.st_size = stat.S_IFREG | 0o444, len(self.data[ino])
        a.st_uid, a.st_gid = os.getuid(), os.getgid()
        return a

    async def lookup(self, parent, name, ctx=None):
        ino = self.children[parent].get(name)
        if ino is None:
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0
            a.entry_timeout = TIMEOUT
            return a
        return self.attr(ino)

    async def getattr(self, ino, ctx=None):
        return self.attr(ino)

    async def opendir(self, ino, ctx):
        return ino

    async def readdir(self, ino, start, token):
        names = self.order[ino]
        for i in range(start, len(names)):
            if not pyfuse3.readdir_reply(token, names[i], self.attr(self.children[ino][names[i]]), i + 1):
                return

    async def open(self, ino, flags, ctx):
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=ino, keep_cache=True)

    async def read(self, fh, off, size):
        return self.data[fh][off:off + size]


def load_tree(fs: NullFS, parent: int, path: str) -> None:
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.is_dir():
            load_tree(fs, fs.add(parent, entry.name, None), entry.path)
        else:
            with open(entry.path, "rb") as f:
                fs.add(parent, entry.name, f.read())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flat", action="store_true")
    parser.add_argument("source")
    parser.add_argument("mountpoint")
    args = parser.parse_args()
    fs = NullFS()
    if args.flat:
        with open(args.source) as f:
            for line in f:
                fs.add(pyfuse3.ROOT_INODE, line.rstrip("\n"), b"\0")
    else:
        load_tree(fs, pyfuse3.ROOT_INODE, args.source)
    options = set(pyfuse3.default_options) | {"ro", "fsname=nullfs"}
    pyfuse3.init(fs, args.mountpoint, options)
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    sys.exit(main())
