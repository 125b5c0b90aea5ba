"""First reads through the `unshard` fsspec filesystem (no mount): against a fresh mount and
TensorStore in-process, on the same chunks of the small dataset."""

from __future__ import annotations

from typing import Any

from ..context import KEY, Context
from ..workloads import timed, warmed_files
from .local import best_fresh, tensorstore_rate

ONE = "first read, fsspec cat_file one by one, 16 KiB chunks"
MANY = "first read, fsspec cat of all files at once"


def run(ctx: Context) -> None:
    import fsspec

    small = ctx.datasets["small"]
    files = warmed_files(small, KEY)

    def fresh_rate(read: Any) -> float:
        """Files/s of `read(fs)` on a fresh instance (a fresh session: cold caches), the better of two."""
        best = 0.0
        for _ in range(2):
            fs = fsspec.filesystem("unshard", source=str(small["sharded"]), skip_instance_cache=True)
            try:
                best = max(best, len(files) / timed(lambda: read(fs)))
            finally:
                fs.close()
        return best

    one = fresh_rate(lambda fs: [fs.cat_file(f) for f in files])
    many = fresh_rate(lambda fs: fs.cat(files))
    mount = best_fresh(ctx, "unshardfs", small["sharded"], files)
    ctx.report.row(ONE, one, "files/s", "fresh mount, same files (cat-like reads)", mount)
    ctx.report.row(ONE, one, "files/s", "TensorStore in-process (sharded)", tensorstore_rate(ctx, files))
    ctx.report.row(MANY, many, "files/s", "fresh mount, same files", mount)
