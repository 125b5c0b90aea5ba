"""DEST, and a manifest, opened by how the user spells them: the one place that tells a local
directory from an object store prefix.

DEST is a path, a file:// URL, or an s3:// or gs:// URL (a bucket and a
prefix); any other scheme is a one-line ConfigError. A manifest is a file
or an object named the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Generator

from unshardfs.dest.base import LINE_LIMIT, Dest
from unshardfs.dest.local import open_local
from unshardfs.dest.objects import open_objects
from unshardfs.sources import RemoteOptions
from unshardfs.util.errors import ConfigError, DataError


def is_object_url(dest: str) -> bool:
    return dest.partition("://")[0].lower() in ("s3", "gs") and "://" in dest


def local_path(dest: str) -> str:
    """DEST as a local path: a file:// URL's path; a URL of another scheme is a ConfigError."""
    scheme, sep, rest = dest.partition("://")
    if not sep:
        return dest
    if scheme.lower() == "file" and rest.startswith("/"):
        return rest
    raise ConfigError(f"DEST {dest}: export writes to a directory (a path or file:///path), s3:// or gs://; "
                      f"{scheme}:// is not supported as DEST")


def dest_name(dest: str) -> str:
    """DEST as every process names it: a local path made absolute, a URL as given."""
    return dest if is_object_url(dest) else str(Path(local_path(dest)).absolute())


def open_dest(dest: str, remote: RemoteOptions | None = None, *, sync: bool = True, create: bool = True) -> Dest:
    """DEST opened: a directory (with `create`, made if missing; else it must be one), or an object
    store prefix (its bucket checked to exist and be reachable); a one-line ConfigError otherwise.
    `sync`: files, records and directories are flushed to stable storage where DEST has any."""
    if is_object_url(dest):
        return open_objects(dest, remote or RemoteOptions())
    return open_local(Path(local_path(dest)), sync, create)


def manifest_lines(path: str, remote: RemoteOptions | None = None) -> Generator[bytes, None, None]:
    """The lines of a manifest in a file or an object (s3://, gs://), streamed, none longer than
    LINE_LIMIT; a one-line ConfigError when it cannot be read."""
    if not is_object_url(path):
        try:
            f = open(path, "rb")  # the user's own path: a symlink to it is followed, as for DEST
        except OSError as e:
            raise ConfigError(f"manifest {path}: {e.strerror}") from None
        with f:
            try:
                yield from iter(lambda: f.readline(LINE_LIMIT), b"")
            except OSError as e:
                raise ConfigError(f"manifest {path}: {e.strerror}") from None
        return
    parent, _, name = path.rstrip("/").rpartition("/")
    if "://" not in parent or not name:
        raise ConfigError(f"manifest {path}: not the URL of an object")
    # Only the object is read: no listing of its bucket is asked for (or allowed).
    dest = open_objects(parent, remote or RemoteOptions(), probe=False)
    try:
        if not dest.records.exists(name):
            raise ConfigError(f"manifest {path}: no such object")
        yield from dest.records.lines(name)
    except DataError as e:
        raise ConfigError(f"manifest {path}: {e.reason}") from None
    finally:
        dest.close()
