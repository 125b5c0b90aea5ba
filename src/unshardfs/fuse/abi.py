"""The FUSE kernel ABI we speak: opcodes, flags and struct layouts of `linux/fuse.h`.

Everything the engine packs or unpacks is described here, once, as `struct`
formats (little-endian host layout, every struct padded to 8 bytes as the
header demands). Field order follows `include/uapi/linux/fuse.h`; protocol
minor versions say from when a feature exists, so INIT can negotiate down to
what the running kernel offers.
"""

from __future__ import annotations

import enum
import mmap
import os
import struct

KERNEL_VERSION = 7
# The newest minor whose structs we lay out; the kernel answers with min(its, ours). 7.41 and 7.42
# add flags only (idmapped mounts, io_uring), and we speak 7.42 only where io_uring is granted.
KERNEL_MINOR = 40
URING_MINOR = 42
# Oldest minor we serve: entry/attr replies and INIT reply sizes below it differ.
MIN_MINOR = 19
ROOT_ID = 1


class Op(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52


# Every opcode that would change the file system: answered EROFS, always.
WRITE_OPS = frozenset({Op.SETATTR, Op.SYMLINK, Op.MKNOD, Op.MKDIR, Op.UNLINK, Op.RMDIR, Op.RENAME, Op.LINK,
                       Op.WRITE, Op.SETXATTR, Op.REMOVEXATTR, Op.CREATE, Op.FALLOCATE, Op.RENAME2,
                       Op.COPY_FILE_RANGE, Op.TMPFILE, Op.SETLK, Op.SETLKW})


class Notify(enum.IntEnum):
    POLL = 1
    INVAL_INODE = 2
    INVAL_ENTRY = 3
    STORE = 4
    RETRIEVE = 5
    DELETE = 6


# INIT flags (fuse_init_in.flags / fuse_init_out.flags), with the minor that introduced them.
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
AUTO_INVAL_DATA = 1 << 12        # 7.20: attribute changes (mtime, size) drop cached pages
DO_READDIRPLUS = 1 << 13         # 7.21
READDIRPLUS_AUTO = 1 << 14       # 7.21: plain READDIR for scans nobody stats
NO_OPEN_SUPPORT = 1 << 17        # 7.23: OPEN answered ENOSYS once -> never sent again
PARALLEL_DIROPS = 1 << 18        # 7.25: no per-directory lock around LOOKUP/READDIR
MAX_PAGES = 1 << 22              # 7.28: init_out.max_pages is honoured
INIT_EXT = 1 << 30               # 7.36: init_in/init_out carry flags2, the upper 32 flag bits
# flags2 bits, as bits 32-63 of one 64-bit flag word
PASSTHROUGH = 1 << 37            # 7.40: OPEN may answer FOPEN_PASSTHROUGH on a registered backing file
OVER_IO_URING = 1 << 41          # 7.42: requests fetched and answered through io_uring (`uring`)

FEATURE_MINOR = {AUTO_INVAL_DATA: 20, DO_READDIRPLUS: 21, READDIRPLUS_AUTO: 21, NO_OPEN_SUPPORT: 23,
                 PARALLEL_DIROPS: 25, MAX_PAGES: 28, INIT_EXT: 36, PASSTHROUGH: 40, OVER_IO_URING: 42}
FEATURE_NAMES = {ASYNC_READ: "async_read", AUTO_INVAL_DATA: "auto_inval_data", DO_READDIRPLUS: "readdirplus",
                 READDIRPLUS_AUTO: "readdirplus_auto", NO_OPEN_SUPPORT: "no_open",
                 PARALLEL_DIROPS: "parallel_dirops", MAX_PAGES: "max_pages", PASSTHROUGH: "passthrough", OVER_IO_URING: "io_uring"}

# fuse_open_out.open_flags
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PASSTHROUGH = 1 << 7       # 7.40: reads and mmap go to the backing file named by backing_id

# The kernel's bound on init_out.max_pages (kernel >= 6.13; 256 before, and where it is absent)
MAX_PAGES_LIMIT_PATH = "/proc/sys/fs/fuse/max_pages_limit"
DEFAULT_MAX_PAGES_LIMIT = 256
# init_out.max_stack_depth for passthrough: backing files may lie on a file system of stack depth
# below it (FILESYSTEM_MAX_STACK_DEPTH is 2). 1: backing files on a disk file system, and an
# overlay may still stack on the mount; a backing file on an overlay is refused (ELOOP) and read
# through the daemon.
PASSTHROUGH_STACK_DEPTH = 1

# ioctls of /dev/fuse (_IOW(229, nr, size)): register a backing file (struct fuse_backing_map:
# fd, flags, padding) -> backing id > 0; drop a backing id (uint32).
BACKING_MAP = struct.Struct("<iIQ")
FUSE_DEV_IOC_BACKING_OPEN = (1 << 30) | (BACKING_MAP.size << 16) | (229 << 8) | 1
FUSE_DEV_IOC_BACKING_CLOSE = (1 << 30) | (4 << 16) | (229 << 8) | 2

# struct fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
IN_HEADER = struct.Struct("<IIQQIIIHH")
_IN_UNIQUE = struct.Struct("<8xQ")  # its `unique` alone


def unique_of(header: bytes | bytearray | memoryview | mmap.mmap) -> int:
    """The `unique` of a request, from its fuse_in_header."""
    (unique,) = _IN_UNIQUE.unpack_from(header)
    return int(unique)
# struct fuse_out_header: len, error (negative errno), unique
OUT_HEADER = struct.Struct("<IiQ")

# struct fuse_init_in (the first four fields are all a kernel before 7.36 sends)
INIT_IN = struct.Struct("<IIII")
INIT_IN_FLAGS2 = struct.Struct("<I")         # flags2, right after INIT_IN (7.36)
# struct fuse_init_out: major, minor, max_readahead, flags, max_background, congestion_threshold,
# max_write, time_gran, max_pages, map_alignment, flags2, max_stack_depth, unused
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
INIT_OUT_COMPAT_22 = 24  # reply size before 7.23

# struct fuse_attr: ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec,
# mode, nlink, uid, gid, rdev, blksize, flags
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
# struct fuse_entry_out: nodeid, generation, entry_valid, attr_valid, entry_valid_nsec,
# attr_valid_nsec, then fuse_attr
ENTRY_OUT = struct.Struct("<QQQQII" + ATTR.format[1:])
# struct fuse_attr_out starts with attr_valid, attr_valid_nsec, dummy; fuse_attr follows
ATTR_OUT_HEAD = struct.Struct("<QII")

FORGET_IN = struct.Struct("<Q")              # nlookup
BATCH_FORGET_IN = struct.Struct("<II")       # count, dummy; then `count` FORGET_ONE
FORGET_ONE = struct.Struct("<QQ")            # nodeid, nlookup
OPEN_IN = struct.Struct("<II")               # flags, open_flags
OPEN_OUT = struct.Struct("<QIi")             # fh, open_flags, backing_id (7.40; padding before)
# struct fuse_read_in: fh, offset, size, read_flags, lock_owner, flags, padding
READ_IN = struct.Struct("<QQIIQII")
RELEASE_IN = struct.Struct("<QIIQ")          # fh, flags, release_flags, lock_owner
GETXATTR_IN = struct.Struct("<II")           # size, padding (name follows, NUL-terminated)
GETXATTR_OUT = struct.Struct("<II")          # size, padding
INTERRUPT_IN = struct.Struct("<Q")           # unique
# struct fuse_kstatfs: blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, padding, spare[6]
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
# struct fuse_dirent: ino, off, namelen, type; then the name, padded to 8 bytes
DIRENT = struct.Struct("<QQII")
NOTIFY_INVAL_INODE = struct.Struct("<Qqq")   # ino, off, len
NOTIFY_INVAL_ENTRY = struct.Struct("<QII")   # parent, namelen, flags; then the name and a NUL

# The read buffer must hold the largest request: max_write bytes of a WRITE plus its headers
# (the kernel refuses smaller reads with EINVAL), and never less than 8 KiB.
MIN_READ_BUFFER = 8192
MAX_WRITE = 64 << 10
READ_BUFFER = MAX_WRITE + 4096


def max_pages_limit(path: str = MAX_PAGES_LIMIT_PATH) -> int:
    """The largest init_out.max_pages the running kernel honours (`sysctl fs.fuse.max_pages_limit`),
    within what the 16-bit field holds; the fixed 256 of kernels without the sysctl."""
    try:
        with open(path) as f:
            limit = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_MAX_PAGES_LIMIT
    return max(1, min(limit, 0xFFFF))


def pad8(n: int) -> int:
    """FUSE_REC_ALIGN: variable-length records are aligned to 8 bytes."""
    return (n + 7) & ~7


def split_time(seconds: float) -> tuple[int, int]:
    """(seconds, nanoseconds) of a timeout, as entry/attr replies carry them."""
    whole = int(seconds)
    return whole, int((seconds - whole) * 1e9)


class FsError(Exception):
    """A request's answer is this errno (ENOENT, ESTALE, ENOTDIR, EROFS, ...), on either engine."""

    def __init__(self, code: int) -> None:
        super().__init__(os.strerror(code))
        self.errno = code
