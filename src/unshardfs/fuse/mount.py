"""Mounting and unmounting a FUSE connection without libfuse.

As root: open /dev/fuse and call mount(2) with `fd=N,rootmode=...,user_id=...,group_id=...`
(the call returns before the kernel's INIT arrives on the fd). As any other
user (or with `-o auto_unmount`): run the setuid `fusermount3`, which mounts
and hands the /dev/fuse fd back over a socketpair named in `_FUSE_COMMFD`
(SCM_RIGHTS). With `auto_unmount` it stays alive watching that socket and
unmounts when this process is gone, even after SIGKILL -- where the kernel
lets it look at the dead mount: as root, or with `allow_other` (fusermount3
3.14 checks the mount by opening it, which the kernel refuses to a setuid
helper acting for a user without `allow_other`: EACCES, so it leaves the
mount for `unshardfs unmount`).

The returned fd is non-blocking (the session waits on it with trio).
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import errno
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field

from unshardfs.util.errors import ConfigError
from unshardfs.util.mountinfo import mounted_at

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_SYNCHRONOUS, MS_DIRSYNC = 16, 128
MS_NOATIME, MS_NODIRATIME, MS_RELATIME, MS_STRICTATIME = 1 << 10, 1 << 11, 1 << 21, 1 << 24
MNT_DETACH = 2

# Options that are mount flags (set, cleared) -- as mount(8) spells them.
FLAG_OPTIONS = {
    "ro": (MS_RDONLY, 0), "nosuid": (MS_NOSUID, 0), "suid": (0, MS_NOSUID), "nodev": (MS_NODEV, 0),
    "dev": (0, MS_NODEV), "noexec": (MS_NOEXEC, 0), "exec": (0, MS_NOEXEC), "sync": (MS_SYNCHRONOUS, 0),
    "async": (0, MS_SYNCHRONOUS), "dirsync": (MS_DIRSYNC, 0), "noatime": (MS_NOATIME, 0),
    "nodiratime": (MS_NODIRATIME, 0), "relatime": (MS_RELATIME, 0), "strictatime": (MS_STRICTATIME, 0),
    "atime": (0, MS_NOATIME),
}
# Options the kernel's fuse file system itself takes (passed in mount(2)'s data).
KERNEL_OPTIONS = ("allow_other", "default_permissions")
KERNEL_VALUE_OPTIONS = ("max_read",)
# mount(8)/fstab options meaningless to the mount itself.
IGNORED_OPTIONS = ("rw", "nofail", "_netdev", "auto", "noauto", "user", "users", "nouser", "owner", "group",
                   "defaults", "debug")
IGNORED_PREFIXES = ("x-", "comment=")


@dataclass
class Mounted:
    """A live mount: the connection fd, and what keeps fusermount3's auto_unmount watching."""

    fd: int
    mountpoint: str
    via_fusermount: bool
    watcher: socket.socket | None = None
    helper: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def close(self) -> None:
        """Close the connection fd (the mount itself is ended by `unmount`)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.watcher is not None:
            self.watcher.close()
            self.watcher = None
        if self.helper is not None:
            try:
                self.helper.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self.helper = None


@dataclass
class MountSpec:
    mountpoint: str
    fsname: str
    subtype: str = "unshardfs"
    options: list[str] = field(default_factory=list)

    def parse(self) -> tuple[int, list[str], bool]:
        """(mount flags, kernel data options, auto_unmount) from `options`; unknown ones refused."""
        flags = MS_RDONLY | MS_NOSUID | MS_NODEV
        data: list[str] = []
        auto_unmount = False
        for opt in self.options:
            name = opt.split("=", 1)[0]
            if opt in FLAG_OPTIONS:
                on, off = FLAG_OPTIONS[opt]
                flags = (flags | on) & ~off
            elif opt in KERNEL_OPTIONS or name in KERNEL_VALUE_OPTIONS:
                data.append(opt)
            elif opt == "auto_unmount":
                auto_unmount = True
            elif name in ("fsname", "subtype"):
                setattr(self, name, opt.split("=", 1)[1] if "=" in opt else "")
            elif opt in IGNORED_OPTIONS or opt.startswith(IGNORED_PREFIXES):
                continue
            else:
                raise ConfigError(f"unknown mount option {opt!r}")
        return flags | MS_RDONLY, data, auto_unmount  # always read-only


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def mount(spec: MountSpec) -> Mounted:
    """Mount a FUSE file system on `spec.mountpoint`; its connection fd is returned."""
    flags, data, auto_unmount = spec.parse()
    if os.geteuid() == 0 and not auto_unmount:
        return _mount_root(spec, flags, data)
    return _mount_fusermount(spec, flags, data, auto_unmount)


def _mount_root(spec: MountSpec, flags: int, data: list[str]) -> Mounted:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"cannot open /dev/fuse: {e.strerror} (is the fuse module loaded?)") from None
    try:
        rootmode = stat.S_IFMT(os.stat(spec.mountpoint).st_mode)
        options = ",".join([f"fd={fd}", f"rootmode={rootmode:o}", f"user_id={os.getuid()}",
                            f"group_id={os.getgid()}", *data])
        fstype = f"fuse.{spec.subtype}" if spec.subtype else "fuse"
        result = _libc().mount(spec.fsname.encode(), spec.mountpoint.encode(), fstype.encode(), flags,
                               options.encode())
        if result != 0:
            err = ctypes.get_errno()
            raise ConfigError(f"cannot mount on {spec.mountpoint}: {os.strerror(err)}")
    except BaseException:
        os.close(fd)
        raise
    os.set_blocking(fd, False)
    return Mounted(fd, spec.mountpoint, via_fusermount=False)


def _mount_fusermount(spec: MountSpec, flags: int, data: list[str], auto_unmount: bool) -> Mounted:
    helper = shutil.which("fusermount3")
    if helper is None:
        raise ConfigError("fusermount3 not found: install fuse3 (it mounts FUSE file systems for users)")
    names = [name for name, (on, _off) in FLAG_OPTIONS.items() if on and flags & on == on and on != MS_RDONLY]
    options = ["ro", f"fsname={spec.fsname}", f"subtype={spec.subtype}", *names, *data]
    if auto_unmount:
        options.append("auto_unmount")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    # Its messages go to a file, not a pipe: with auto_unmount it outlives our reading end, and a
    # write to a closed pipe would kill it (and with it the clean-up it is there for).
    errors = tempfile.TemporaryFile()
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        proc = subprocess.Popen([helper, "-o", ",".join(o.replace(",", "\\,") for o in options), "--",
                                 spec.mountpoint], env=env, pass_fds=(theirs.fileno(),),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors)
        theirs.close()
        fd = _receive_fd(ours)
        if fd is None:
            proc.wait(timeout=30)
            errors.seek(0)
            detail = errors.read().decode(errors="replace").strip().splitlines()
            raise ConfigError(f"cannot mount on {spec.mountpoint}: "
                              f"{detail[-1] if detail else 'fusermount3 failed'}")
    except BaseException:
        ours.close()
        theirs.close()
        raise
    finally:
        errors.close()
    os.set_inheritable(fd, False)
    os.set_blocking(fd, False)
    if auto_unmount:
        # fusermount3 watches our end of the socket: it unmounts once this process is gone.
        return Mounted(fd, spec.mountpoint, via_fusermount=True, watcher=ours, helper=proc)
    ours.close()
    proc.wait(timeout=30)
    return Mounted(fd, spec.mountpoint, via_fusermount=True)


def _receive_fd(sock: socket.socket) -> int | None:
    """The fd fusermount3 sends (one byte of data, one SCM_RIGHTS fd), or None if it failed."""
    fds = array.array("i")
    try:
        msg, ancdata, _flags, _addr = sock.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
    except OSError:
        return None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    return fds[0] if fds else None


def _device(target: str) -> str | None:
    """The device (major:minor) mounted on `target`, from /proc/self/mountinfo (the last mount
    there wins), never by touching the path."""
    entry = mounted_at(target)
    return None if entry is None else entry.device


def listed(target: str) -> bool:
    """Whether something is mounted on `target` (an absolute path)."""
    return _device(target) is not None


def set_readahead(target: str, kib: int) -> bool:
    """Raise the kernel's read-ahead for the mount on `target` (its real path, resolved before
    mounting) so buffered sequential reads arrive as requests of up to `kib` instead of 128 KiB.
    Root only; found through /proc/self/mountinfo, never by touching the mount: nobody answers
    it yet, so even a stat of it would wait forever."""
    try:
        device = _device(target)
        if device is None:
            return False
        with open(f"/sys/class/bdi/{device}/read_ahead_kb", "w") as f:
            f.write(str(kib))
        return True
    except OSError:
        return False


def unmount(mountpoint: str, lazy: bool = False) -> None:
    """End the mount (the session's reads then fail with ENODEV and it stops)."""
    if os.geteuid() == 0:
        if _libc().umount2(mountpoint.encode(), MNT_DETACH if lazy else 0) == 0:
            return
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):  # not mounted (any more)
            return
        if not lazy and err == errno.EBUSY:
            raise OSError(err, os.strerror(err), mountpoint)
    result = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), "--", mountpoint],
                            capture_output=True, text=True)
    if result.returncode != 0 and listed(os.path.abspath(mountpoint)):
        raise OSError(errno.EBUSY, result.stderr.strip() or "fusermount3 -u failed", mountpoint)
