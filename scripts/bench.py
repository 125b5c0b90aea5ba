"""unshardfs benchmark: every figure next to a baseline measured in the same run.

Baselines: a null pyfuse3 file system serving the same files from memory
(the ceiling of FUSE + pyfuse3), the unsharded files on tmpfs and on local
disk, TensorStore reading the same chunks in-process from the shards, and
ratarmount serving a tar of the unsharded chunks.

Usage: scripts/bench [--full] [--json FILE] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

PY = sys.executable
UNSHARDFS = [PY, "-m", "unshardfs"]


# -- mounts ------------------------------------------------------------------

def wait_mounted(path: Path, proc: subprocess.Popen | None = None, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.ismount(path):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mount process exited: {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not mount")
        time.sleep(0.02)


def unmount(path: Path) -> None:
    for flags in ("-u", "-uz"):
        if not os.path.ismount(path):
            return
        subprocess.run(["fusermount3", flags, str(path)], capture_output=True)
        time.sleep(0.1)


@contextmanager
def mounted(kind: str, source: Path, workdir: Path, *options: str) -> Iterator[Path]:
    mnt = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=workdir))
    proc = None
    try:
        if kind == "unshardfs":
            subprocess.run([*UNSHARDFS, "mount", str(source), str(mnt), *options], check=True)
        elif kind == "nullfs":
            proc = subprocess.Popen([PY, str(HERE / "nullfs.py"), *options, str(source), str(mnt)],
                                    stdout=subprocess.DEVNULL)
            wait_mounted(mnt, proc)
        elif kind == "ratarmount":
            subprocess.run([str(Path(PY).parent / "ratarmount"), str(source), str(mnt)], check=True,
                           capture_output=True)
            wait_mounted(mnt)
        yield mnt
    finally:
        unmount(mnt)
        if proc is not None:
            proc.wait(timeout=30)
        shutil.rmtree(mnt, ignore_errors=True)


def daemon_pid(mnt: Path) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(mnt).encode() in argv and b"--foreground" in argv:
                return int(entry.name)
    raise RuntimeError("daemon not found")


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


# -- workloads ---------------------------------------------------------------

def read_files(paths: list[str], chunk: int = 1 << 20) -> int:
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while data := os.read(fd, chunk):
                total += len(data)
        finally:
            os.close(fd)
    return total


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _reader_proc(paths: list[str], queue) -> None:
    queue.put(read_files(paths))


def parallel_read(paths: list[str], n: int) -> float:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    groups = [paths[i::n] for i in range(n)]
    procs = [ctx.Process(target=_reader_proc, args=(g, queue)) for g in groups]
    start = time.perf_counter()
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - start
    for _ in procs:
        queue.get()
    return elapsed


def warm_page_cache(directory: Path) -> None:
    for p in directory.rglob("*"):
        if p.is_file():
            p.read_bytes()


def rel_files(root: Path, sub: str) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / sub).iterdir())


# -- datasets ----------------------------------------------------------------

def build_datasets(data: Path, full: bool) -> dict:
    from unshardfs.testing.precomputed import Scale, sharding, write_volume
    import bench_data

    data.mkdir(parents=True, exist_ok=True)
    marker = data / ("ready-full" if full else "ready")
    out = {
        "small": {"sharded": data / "small" / "sharded", "plain": data / "small" / "plain"},
        "large": {"sharded": data / "large" / "sharded", "plain": data / "large" / "plain"},
        "million": data / "million",
        "shards4096": data / "shards4096",
    }
    if full:
        out["tenmillion"] = data / "tenmillion"
    if marker.exists():
        return out
    print("building benchmark datasets (once) ...", flush=True)
    # 4096 chunks of 16 KiB: small-file work.
    write_volume(data / "small", [Scale((512, 512, 256), (32, 32, 16),
                                        sharding(minishard=6, shard=3, index_enc="gzip"))], "uint8")
    # 64 chunks of 2 MiB raw: big sequential reads.
    write_volume(data / "large", [Scale((512, 512, 256), (128, 128, 128),
                                        sharding(minishard=1, shard=2))], "uint8")
    names = bench_data.write_scale(data / "million", (100, 100, 100), minishard_bits=6, shard_bits=8)
    (data / "million.names").write_text("\n".join(names) + "\n")
    bench_data.write_scale(data / "shards4096", (64, 64, 16), minishard_bits=2, shard_bits=12)
    if full:
        bench_data.write_scale(data / "tenmillion", (250, 200, 200), minishard_bits=8, shard_bits=10)
    marker.write_text("ok")
    return out


# -- the measurements --------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="unshardfs-bench-"))
    ds = build_datasets(Path(args.data).resolve(), args.full)
    small, large = ds["small"], ds["large"]
    key = "1_1_1"
    results: dict[str, dict] = {}
    rows: list[tuple[str, str, float, str, float, str]] = []

    def row(metric: str, ours: float, unit: str, baseline_name: str, baseline: float, target: str = "") -> None:
        ratio = ours / baseline if baseline else float("nan")
        rows.append((metric, f"{ours:,.1f} {unit}", ratio, baseline_name, baseline, target))
        results.setdefault(metric, {})[baseline_name] = {"ours": ours, "baseline": baseline, "ratio": ratio,
                                                         "unit": unit, "target": target}

    warm_page_cache(small["sharded"])
    warm_page_cache(small["plain"])
    files = rel_files(small["plain"], key)
    n = len(files)

    # tmpfs and disk copies of the unsharded chunks
    shm = Path(tempfile.mkdtemp(prefix="bench-", dir="/dev/shm"))
    shutil.copytree(small["plain"], shm / "plain")
    disk = work / "disk"
    shutil.copytree(small["plain"], disk)
    warm_page_cache(disk)

    def rate(root: Path) -> float:
        paths = [str(root / f) for f in files]
        return n / timed(lambda: read_files(paths))

    # 1. warm re-read
    with mounted("unshardfs", small["sharded"], work) as m:
        rate(m)
        ours_warm = max(rate(m) for _ in range(3))
    with mounted("nullfs", small["plain"], work) as m:
        rate(m)
        null_warm = max(rate(m) for _ in range(3))
    tmpfs_warm = max(rate(shm / "plain") for _ in range(3))
    disk_warm = max(rate(disk) for _ in range(3))
    row("warm re-read, 16 KiB chunks", ours_warm, "files/s", "null pyfuse3 fs", null_warm, ">= 0.8")
    row("warm re-read, 16 KiB chunks", ours_warm, "files/s", "tmpfs", tmpfs_warm)
    row("warm re-read, 16 KiB chunks", ours_warm, "files/s", "local disk (page cache)", disk_warm)

    # 2. first read on a fresh mount (shards in the page cache)
    def first(kind: str, source: Path, *opts: str) -> float:
        best = 0.0
        for _ in range(2):
            with mounted(kind, source, work, *opts) as m:
                best = max(best, rate(m))
        return best

    ours_first = first("unshardfs", small["sharded"])
    null_first = first("nullfs", small["plain"])
    row("first read, fresh mount", ours_first, "files/s", "null pyfuse3 fs", null_first, ">= 0.6")
    tar = work / "small.tar"
    with tarfile.open(tar, "w") as t:
        t.add(small["plain"] / key, arcname=key)
    if shutil.which("ratarmount", path=str(Path(PY).parent)):
        with mounted("ratarmount", tar, work):
            pass  # builds its index once, outside the timing
        rat_first = first("ratarmount", tar)
        row("first read, fresh mount", ours_first, "files/s", "ratarmount (tar)", rat_first, "> 1")
    import tensorstore as ts
    from unshardfs.formats.precomputed.morton import MortonCoder

    info = json.loads((small["sharded"] / "info").read_text())["scales"][0]
    kv = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded", "base": f"file://{small['sharded']}/{key}/",
                          "metadata": info["sharding"]}).result()
    grid = [s // c for s, c in zip(info["size"], info["chunk_sizes"][0])]
    coder = MortonCoder(tuple(grid))
    keys = []
    for name in files:
        begins = [int(part.split("-")[0]) for part in name.split("/")[-1].split("_")]
        cell = tuple(b // c for b, c in zip(begins, info["chunk_sizes"][0]))
        keys.append(coder.encode(cell).to_bytes(8, "big"))

    def ts_read() -> None:
        kv2 = ts.KvStore.open({"driver": "neuroglancer_uint64_sharded",
                               "base": f"file://{small['sharded']}/{key}/", "metadata": info["sharding"],
                               "context": {"cache_pool": {"total_bytes_limit": 0}}}).result()
        for k in keys:
            kv2.read(k).result()

    ts_first = n / min(timed(ts_read) for _ in range(2))
    row("first read, fresh mount", ours_first, "files/s", "TensorStore in-process (sharded)", ts_first)
    del kv

    # 3. parallel readers
    def par(readers: int) -> float:
        best = 0.0
        for _ in range(2):
            with mounted("unshardfs", small["sharded"], work) as m:
                best = max(best, n / parallel_read([str(m / f) for f in files], readers))
        return best

    one, eight = par(1), par(8)
    row("8 parallel readers (first read)", eight, "files/s", "1 reader, same mount", one, ">= 1.3")

    # 4. backing reads during cp -r of a scale
    with mounted("unshardfs", small["sharded"], work) as m:
        before = json.loads(os.getxattr(m, "user.unshardfs.stats"))["source"]["reads"]
        subprocess.run(["cp", "-r", str(m / key), str(work / "copy")], check=True)
        s = json.loads(os.getxattr(m, "user.unshardfs.stats"))
        reads = s["source"]["reads"] - before
        idx = s["caches"]["shard_index"]["entries"] + s["caches"]["minishard_index"]["entries"]
        results["backing reads per chunk (cp -r)"] = {"reads": reads, "index_reads": idx, "chunks": n,
                                                      "per_chunk": (reads - idx) / n}
    shutil.rmtree(work / "copy")

    # 5. ls -f / find / ls -l of a 1,000,000-chunk scale, and memory
    million_names = Path(str(ds["million"]) + ".names")

    def ls_time(root: Path) -> tuple[float, int]:
        start = time.perf_counter()
        out = subprocess.run(["ls", "-f", str(root)], capture_output=True, check=True).stdout
        return time.perf_counter() - start, out.count(b"\n")

    warm_page_cache(ds["million"])
    with mounted("unshardfs", ds["million"], work) as m:
        ours_ls, count = ls_time(m / "s0")
        assert count >= 1_000_000, count
    with mounted("unshardfs", ds["million"], work) as m:
        ours_ls = min(ours_ls, ls_time(m / "s0")[0])
        find_count = int(subprocess.run(f"find {m}/s0 -type f | wc -l", shell=True, capture_output=True,
                                        text=True).stdout)
        lsl = subprocess.run(["ls", "-l", str(m / "s0")], capture_output=True, check=True).stdout.count(b"\n")
        pid = daemon_pid(m)
        paths = [str(m / "s0" / name) for name in random.Random(0).sample(
            million_names.read_text().split(), 10_000)]
        read_files(paths)
        mem = memory_kib(pid)
    null_ls = float("inf")
    for _ in range(2):
        with mounted("nullfs", million_names, work, "--flat") as m:
            null_ls = min(null_ls, ls_time(m)[0])
    row("ls -f, 1,000,000 chunks", ours_ls, "s", "null pyfuse3 fs", null_ls, "<= 10 s")
    results["find / ls -l, 1,000,000 chunks"] = {"find": find_count, "ls -l lines": lsl}
    results["daemon memory after 1M listing + 10k reads"] = mem

    if args.full:
        with mounted("unshardfs", ds["tenmillion"], work) as m:
            t10, count10 = ls_time(m / "s0")
            mem10 = memory_kib(daemon_pid(m))
        results["ls -f, 10,000,000 chunks"] = {"seconds": t10, "entries": count10, **mem10}

    # 6. mount time, 4096 shards
    mount_times = []
    for _ in range(3):
        mnt = Path(tempfile.mkdtemp(dir=work))
        mount_times.append(timed(lambda: subprocess.run([*UNSHARDFS, "mount", str(ds["shards4096"]), str(mnt)],
                                                         check=True)))
        os.listdir(mnt / "s0")
        unmount(mnt)
    results["mount time, 4096 shards (s)"] = {"min": min(mount_times), "target": "<= 1 s"}

    # 7. sequential read of 2 MiB raw chunks vs the shard files natively
    warm_page_cache(large["sharded"])
    shard_paths = [str(p) for p in sorted((large["sharded"] / key).glob("*.shard"))]
    shard_bytes = sum(os.path.getsize(p) for p in shard_paths)
    native = max(shard_bytes / timed(lambda: read_files(shard_paths)) for _ in range(3))
    big_files = rel_files(large["plain"], key)
    big_bytes = sum((large["plain"] / f).stat().st_size for f in big_files)

    def seq(*opts: str) -> float:
        best = 0.0
        for _ in range(2):
            with mounted("unshardfs", large["sharded"], work, *opts) as m:
                best = max(best, big_bytes / timed(lambda: read_files([str(m / f) for f in big_files])))
        return best

    ours_seq = seq()
    null_seq = 0.0
    for _ in range(2):
        with mounted("nullfs", large["plain"], work) as m:
            null_seq = max(null_seq, big_bytes / timed(lambda: read_files([str(m / f) for f in big_files])))
    row("sequential read, 2 MiB raw chunks", ours_seq / 2**20, "MiB/s", "native read of the shards",
        native / 2**20, ">= 0.5")
    row("sequential read, 2 MiB raw chunks", ours_seq / 2**20, "MiB/s", "null pyfuse3 fs", null_seq / 2**20)

    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    decode_rows(row)
    http_rows(row, small, work)
    results["_rows"] = rows
    results["_machine"] = {"cpus": os.cpu_count(), "kernel": platform.release(),
                           "python": platform.python_version(), "n_small_chunks": n}
    return results


def decode_rows(row: Callable[..., None]) -> None:
    """8. DVID label block decoding, per 64^3 block, vs gunzip of the same labels as a raw chunk."""
    import zlib

    from unshardfs.testing.dvid import encode_volume, sample_volume

    from unshardfs.formats.dvid.block import decode_block

    blocks = [data for data, _ in encode_volume(sample_volume((256, 256, 128), 5)).values()]
    raw = [zlib.compress(decode_block(b).tobytes(), 6) for b in blocks]
    rounds = 5

    def per_second(fn: Callable[[bytes], object], items: list[bytes]) -> float:
        best = min(timed(lambda: [fn(item) for item in items]) for _ in range(rounds))
        return len(items) / best

    ours = per_second(decode_block, blocks)
    gunzip = per_second(zlib.decompress, raw)
    row("DVID block decode, 64^3 (realistic mix)", ours, "blocks/s", "zlib gunzip of the raw chunk", gunzip)
    print(f"decoded {len(blocks)} blocks ({sum(map(len, blocks)) / len(blocks) / 1024:.1f} KiB compressed on "
          f"average): {1e3 / ours:.2f} ms per block, {ours * 2:.0f} MiB/s of uint64 labels", file=sys.stderr)


def _bare_client(base: str, shards: list[str], n: int, queue) -> None:
    import httpx
    import trio

    async def main() -> float:
        limiter = trio.CapacityLimiter(8)
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=8)) as client:
            async def one(i: int) -> None:
                async with limiter:
                    at = (i // len(shards)) * 16384
                    await client.get(f"{base}/{shards[i % len(shards)]}", headers={"Range": f"bytes={at}-{at + 16383}"})
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
            return n / (time.perf_counter() - start)
    queue.put(trio.run(main))


def http_rows(row: Callable[..., None], small: dict, work: Path) -> None:
    """9. First read through a local HTTP server (Python's threaded http.server, Range support)."""
    from unshardfs.testing.http_servers import DatasetServer

    key = "1_1_1"
    files = rel_files(small["plain"], key)
    warm_page_cache(small["sharded"])

    def first_read(source: str) -> float:
        with mounted("unshardfs", source, work) as m:  # type: ignore[arg-type]
            return len(files) / parallel_read([str(m / f) for f in files], 8)

    local = max(first_read(str(small["sharded"])) for _ in range(2))
    shards = sorted(p.name for p in (small["sharded"] / key).glob("*.shard"))
    with DatasetServer(small["sharded"]) as server:
        remote = 0.0
        for _ in range(2):
            server.reset_log()
            remote = max(remote, first_read(server.url))
            requests = len(server.requests())
        # What the server itself sustains: the same number of 16 KiB ranged GETs from a bare
        # httpx client (8 in flight), in a process of its own like the daemon.
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        proc = ctx.Process(target=_bare_client, args=(f"{server.url}/{key}", shards, len(files), queue))
        proc.start()
        bare = queue.get()
        proc.join()
    row("first read over HTTP, 8 readers", remote, "files/s", "bare httpx client, same server", bare)
    row("first read over HTTP, 8 readers", remote, "files/s", "same, local shards", local)
    per_chunk = requests / len(files)
    # The small scale has 8 shards of 64 minishards: a HEAD and a shard index per shard, each
    # minishard index once, then one GET per chunk is the least any ranged reader can do.
    least = (8 * 2 + 8 * 64 + len(files)) / len(files)
    row("HTTP requests per chunk (first read)", per_chunk, "req", "HEAD + indexes + 1 per chunk", least)
    print(f"http: {requests} requests for {len(files)} chunks of {key}", file=sys.stderr)


def print_table(results: dict) -> None:
    m = results["_machine"]
    print(f"\nunshardfs benchmark - {m['cpus']} CPUs, Linux {m['kernel']}, Python {m['python']}\n")
    print(f"{'metric':38} {'unshardfs':>16}  {'ratio':>6}  {'baseline':34} {'baseline value':>14}  target")
    for metric, ours, ratio, base, value, target in results["_rows"]:
        print(f"{metric:38} {ours:>16}  {ratio:6.2f}  {base:34} {value:14,.1f}  {target}")
    print()
    for k, v in results.items():
        if not k.startswith("_") and "ours" not in json.dumps(v):
            print(f"{k}: {json.dumps(v)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="also list a 10,000,000-chunk scale")
    parser.add_argument("--json", help="write the numbers to this file")
    parser.add_argument("--data", default=str(REPO / "bench-data"), help="where datasets are built and reused")
    parser.add_argument("--only", choices=("decode", "http"),
                        help="run one section only (decode: DVID block decoding; http: reads through HTTP)")
    args = parser.parse_args()
    if args.only:
        rows: list = []

        def row(metric, ours, unit, baseline_name, baseline, target=""):
            rows.append((metric, f"{ours:,.1f} {unit}", ours / baseline, baseline_name, baseline, target))
        if args.only == "decode":
            decode_rows(row)
        else:
            work = Path(tempfile.mkdtemp(prefix="unshardfs-bench-"))
            http_rows(row, build_datasets(Path(args.data).resolve(), False)["small"], work)
            shutil.rmtree(work, ignore_errors=True)
        results = {"_rows": rows, "_machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                               "python": platform.python_version()}}
    else:
        results = run(args)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
