"""`serve` under abusive clients: each kind attacks from another process for a few seconds while a
well-behaved client reads. The well-behaved client must get exact bytes, each request within a second;
the server's peak RSS stays bounded and nothing is answered with a 5xx."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import os
import resource
import select
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import trio

from tests.support.memory import peak_rss
from tests.support.served import serving
from unshardfs.http.app import TreeApp
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.tree.nodes import DirNode, FileNode

KEY = "1_1_1"
BIG = 32 << 20
ATTACK_SECONDS = 3.0
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("abuse")
    volume = write_volume(root / "volume", [Scale((64, 64, 32), (16, 16, 8),
                                                  sharding(minishard=1, shard=2, data_enc="gzip"))], "uint16")
    big = bytes(range(256)) * (BIG // 256)
    (volume["sharded"] / "big.bin").write_bytes(big)  # a passthrough file: answers of many pieces
    plain = volume["plain"] / KEY
    chunks = {f"/{KEY}/{name}": (plain / name).read_bytes() for name in sorted(os.listdir(plain))}
    return {"source": str(volume["sharded"]), "chunks": chunks, "big": big}


# -- the well-behaved client and the measurements -------------------------------------


def fetch(url: str, path: str, headers: dict | None = None, timeout: float = 3) -> tuple[int, bytes, float]:
    """One request on a new connection (a newcomer is what a connection attack starves first)."""
    parts = urlsplit(url)
    began = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read(), time.monotonic() - began
    finally:
        conn.close()


def read_well(url: str, site: dict, seconds: float) -> int:
    """Chunks and 256 KiB ranges of the big file for `seconds`: exact, each within a second. Returns the count."""
    chunks = list(site["chunks"].items())
    deadline = time.monotonic() + seconds
    done = 0
    while time.monotonic() < deadline:
        path, want = chunks[done % len(chunks)]
        status, body, took = fetch(url, path)
        assert (status, body == want) == (200, True), path
        assert took < 1, f"{path} took {took:.2f} s"
        start = (done * 1_234_567) % (BIG - (256 << 10))
        status, body, took = fetch(url, "/big.bin", {"Range": f"bytes={start}-{start + (256 << 10) - 1}"})
        assert (status, body == site["big"][start:start + (256 << 10)]) == (206, True), start
        assert took < 1, f"range at {start} took {took:.2f} s"
        done += 1
    return done


def server_stats(url: str) -> dict:
    status, body, _ = fetch(url, "/_unshardfs/stats")
    assert status == 200
    return json.loads(body)


def access_statuses(log: Path) -> list[int]:
    """The status of every request in the access log."""
    return [int(line.split()[-1]) for line in log.read_text().splitlines()
            if "unshardfs.http.app:" in line and line.split()[-1].isdigit()]


class Attack:
    """An attacker process running `target(host, port, stop, results)` until stopped; its results (a dict)."""

    def __init__(self, url: str, target, *args) -> None:
        context = multiprocessing.get_context("fork")
        parts = urlsplit(url)
        self.stop = context.Event()
        self.results = context.Queue()
        self.process = context.Process(target=_attacker, args=(target, parts.hostname, parts.port, self.stop,
                                                               self.results, *args), daemon=True)

    def __enter__(self) -> Attack:
        self.process.start()
        time.sleep(0.5)  # the attack is under way before the well-behaved client starts
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        try:
            self.outcome = self.results.get(timeout=20)
        except Exception:  # noqa: BLE001 - an attacker that died reports nothing
            self.outcome = {}
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()


def measure(site, url: str, pid: int, attack_target, *args, rss_growth: int) -> dict:
    """Warm the server, run the attack with the well-behaved client alongside; check RSS. The attack's results."""
    read_well(url, site, 0.3)
    before = peak_rss(pid)
    with Attack(url, attack_target, *args) as attack:
        assert read_well(url, site, ATTACK_SECONDS) > 0
    growth = peak_rss(pid) - before
    assert growth < rss_growth, f"peak RSS grew by {growth >> 20} MiB during the attack"
    return attack.outcome


# -- the attackers (each in its own process) -------------------------------------------


def _attacker(target, host, port, stop, results, *args) -> None:
    """Run one attack in this forked process; an attacker that fails says why instead of reporting nothing.

    The process is forked from pytest, which may hold many descriptors late in a full run: the
    attacker takes the hard limit so its hundreds of sockets fit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        target(host, port, stop, results, *args)
    except BaseException as e:  # noqa: BLE001 - reported to the test, which fails with it
        results.put({"error": repr(e)})
        raise


def _connect(host: str, port: int, rcvbuf: int | None = None) -> socket.socket | None:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(2)
    try:
        s.connect((host, port))
    except OSError:
        s.close()
        return None
    s.setblocking(False)
    return s


def _closed_by_server(sockets: list[socket.socket]) -> list[socket.socket]:
    """The sockets the server has answered or closed (readable); each is drained and closed."""
    if not sockets:
        return []
    # poll, not select: select refuses descriptors past FD_SETSIZE (1024), which a full test run reaches.
    poller = select.poll()
    for s in sockets:
        poller.register(s, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(0)}
    readable = [s for s in sockets if s.fileno() in ready]
    for s in readable:
        try:
            s.recv(1 << 16)
        except OSError:
            pass
        s.close()
    return readable


def stalled_readers(host, port, stop, results, count: int) -> None:
    """`count` clients asking for the big file and never reading it, replaced as the server drops them."""
    held: list[tuple[socket.socket, float]] = []
    opened = 0
    while not stop.is_set():
        while len(held) < count and not stop.is_set():
            s = _connect(host, port, rcvbuf=4096)
            if s is None:
                break
            s.sendall(b"GET /big.bin HTTP/1.1\r\nHost: x\r\n\r\n")
            held.append((s, time.monotonic()))
            opened += 1
        time.sleep(0.2)
        # A connection the server gave up on shows as reset or EOF only once read; replace the oldest.
        now = time.monotonic()
        for s, since in [h for h in held if now - h[1] > 1.5][:count // 4]:
            s.close()
            held.remove((s, since))
    for s, _ in held:
        s.close()
    results.put({"opened": opened})


def held_connections(host, port, stop, results, count: int, head: bytes, drip: bytes) -> None:
    """`count` connections that send `head`, then `drip` every 0.3 s, reopened as the server closes them.

    Idle connections send nothing; slow-header clients start a head and never finish it.
    """
    held: list[socket.socket] = []
    opened = closed = 0
    while not stop.is_set():
        while len(held) < count and not stop.is_set():
            s = _connect(host, port)
            if s is None:
                break
            s.send(head)
            held.append(s)
            opened += 1
        for s in _closed_by_server(held):
            held.remove(s)
            closed += 1
        for s in held if drip else ():
            try:
                s.send(drip)
            except OSError:
                pass
        time.sleep(0.3 if drip else 0.05)
    for s in held:
        s.close()
    results.put({"opened": opened, "closed": closed})


def _status_of(host: str, port: int, request: bytes) -> int:
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(request)
        head = b""
        while b"\r\n" not in head:
            data = s.recv(1 << 16)
            if not data:
                return 0  # closed without an answer
            head += data
    return int(head.split(b" ", 2)[1])


def _expensive_requests() -> list[bytes]:
    deep = "/".join(["a"] * 4000)
    weird = [
        {"Range": "bytes=" + "9" * 5000 + "-"},
        {"Range": "bytes=-" + "9" * 5000},
        {"Range": "bytes=" + ",".join(f"{i}-{i}" for i in range(1200))},
        {"If-None-Match": ", ".join(f'"{i:x}-{i:x}"' for i in range(1200))},
        {"If-Modified-Since": "Mon, 01 Jan 99999999999 00:00:00 GMT"},
        {"If-Modified-Since": "x" * 8000},
        {f"X-{i}": "1" for i in range(1500)},
    ]
    requests = [f"GET /big.bin HTTP/1.1\r\nHost: x\r\n{''.join(f'{k}: {v}' + chr(13) + chr(10) for k, v in h.items())}"
                "\r\n" for h in weird]
    requests += [f"GET /{deep} HTTP/1.1\r\nHost: x\r\n\r\n", f"GET /{KEY}/{'x' * 7000} HTTP/1.1\r\nHost: x\r\n\r\n",
                 "GET /big.bin?" + "&".join(f"a{i}=1" for i in range(1500)) + " HTTP/1.1\r\nHost: x\r\n\r\n",
                 "GET /?page=999999999&format=json&page=1 HTTP/1.1\r\nHost: x\r\n\r\n",
                 f"GET /{KEY}/?page={'9' * 5000} HTTP/1.1\r\nHost: x\r\n\r\n",
                 "OPTIONS /info HTTP/1.1\r\nHost: x\r\nOrigin: o\r\nAccess-Control-Request-Headers: "
                 + "a" * 1023 + " b" + " " * 3000 + "\r\n\r\n",
                 "GET /info HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\nabc",
                 "GET /%ff%fe/%00/..%2f HTTP/1.1\r\nHost: x\r\n\r\n",
                 "BREW /info HTTP/1.1\r\nHost: x\r\n\r\n"]
    return [r.encode("latin-1") for r in requests]


def _oversized_heads() -> list[bytes]:
    """Request heads over the 16 KiB limit, each to be sent in one piece."""
    return [b"GET /info HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 60_000 + b"\r\n\r\n",
            b"GET /info HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"b" * 20) for i in range(2000))
            + b"\r\n",
            b"GET /info HTTP/1.1\r\nHost: x\r\nX-Edge: " + b"c" * (17 << 10) + b"\r\n\r\n"]


def request_loop(host, port, stop, results, requests: list[bytes]) -> None:
    """`requests` sent in turn, each on a new connection, until stopped; how often each status came back."""
    statuses: dict[int, int] = {}
    i = 0
    while not stop.is_set():
        status = _status_of(host, port, requests[i % len(requests)])
        statuses[status] = statuses.get(status, 0) + 1
        i += 1
    results.put({"statuses": statuses})


# -- the tests ----------------------------------------------------------------------


def test_clients_that_stop_reading_are_dropped_and_memory_stays_bounded(site, tmp_path):
    log = tmp_path / "serve.log"
    # A send timeout of 2 s, not less: the well-behaved client is this test process, which a full
    # run on two cores can leave unscheduled for a second; a stalled reader is dropped within the
    # attack either way.
    with serving(site["source"], "--access-log", "--send-timeout", "2", "--response-buffer", "8", log=log) as (url, p):
        outcome = measure(site, url, p.pid, stalled_readers, 48, rss_growth=40 << 20)
        connections = server_stats(url)["connections"]
    assert outcome["opened"] >= 48
    # Each stalled answer ended: dropped past the send timeout or for the response budget.
    assert connections["dropped_slow"] + connections["dropped_for_memory"] >= 48, connections
    assert all(s < 500 for s in access_statuses(log))


def test_idle_connections_past_the_descriptor_limit(site, tmp_path):
    log = tmp_path / "serve.log"
    with serving(site["source"], "--access-log", files_limit=(256, 256), log=log) as (url, p):
        limits = Path(f"/proc/{p.pid}/limits").read_text()
        outcome = measure(site, url, p.pid, held_connections, 600, b"", b"", rss_growth=32 << 20)
        connections = server_stats(url)["connections"]
    assert outcome["opened"] > 256 and outcome["closed"] > 0
    assert connections["evicted_idle"] > 0 and connections["open"] <= (256 - 64) // 2, connections
    assert all(s < 500 for s in access_statuses(log))
    assert "Max open files            256                  256" in limits


def test_soft_descriptor_limit_raised_to_the_hard_one(site):
    with serving(site["source"], files_limit=(128, 512)) as (url, p):
        limits = Path(f"/proc/{p.pid}/limits").read_text()
        assert server_stats(url)["connections"]["max_connections"] == (512 - 64) // 2
    assert "Max open files            512                  512" in limits


def test_slow_headers(site, tmp_path):
    log = tmp_path / "serve.log"
    with serving(site["source"], "--access-log", "--header-timeout", "1", files_limit=(256, 256), log=log) as (url, p):
        outcome = measure(site, url, p.pid, held_connections, 300, b"GET /info HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a",
                          rss_growth=32 << 20)
        connections = server_stats(url)["connections"]
    assert outcome["opened"] > 256 and outcome["closed"] > 0
    assert connections["head_timeouts"] + connections["evicted_idle"] > 0, connections
    assert all(s < 500 for s in access_statuses(log))


def test_cheap_requests_that_would_be_expensive(site, tmp_path):
    log = tmp_path / "serve.log"
    with serving(site["source"], "--access-log", log=log) as (url, p):
        outcome = measure(site, url, p.pid, request_loop, _expensive_requests(), rss_growth=32 << 20)
    statuses = outcome["statuses"]
    assert sum(statuses.values()) >= len(_expensive_requests())
    assert all(400 <= s < 500 or s in (200, 204, 206) for s in statuses), statuses
    assert all(s < 500 for s in access_statuses(log))


def test_oversized_heads_in_one_piece(site, tmp_path):
    log = tmp_path / "serve.log"
    with serving(site["source"], "--access-log", log=log) as (url, p):
        outcome = measure(site, url, p.pid, request_loop, _oversized_heads(), rss_growth=32 << 20)
    assert set(outcome["statuses"]) == {431}, outcome
    assert all(s < 500 for s in access_statuses(log))


def test_a_deep_path_costs_lookups_in_proportion_to_the_tree_not_the_path():
    class Dir(DirNode):
        lookups = 0

        async def lookup(self, name):
            Dir.lookups += 1
            return self if name == "d" else (File(3, 0) if name == "f" else None)

    class File(FileNode):
        async def read(self, offset, size):
            return b"abc"[offset:offset + size]

    class Probes(dict):
        count = 0

        def get(self, key, default=None):
            Probes.count += 1
            return super().get(key, default)

    app = TreeApp(Dir(0), dict)
    app._dirs = Probes()
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def get(path: str) -> int:
        sent.clear()
        await app({"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "headers": [],
                   "query_string": b""}, None, send)
        return sent[0]["status"]

    async def main():
        assert await get("/d/d/f") == 200
        Dir.lookups = Probes.count = 0
        assert await get("/" + "/".join(["x"] * 3000) + "/f") == 404
        assert Dir.lookups == 1  # the first name is absent: nothing deeper is looked at
        assert Probes.count <= 1  # one probe of the directory cache, not one per level
        Dir.lookups = 0
        assert await get("/" + "/".join(["d"] * 50) + "/f") == 200
        assert Dir.lookups <= 51

    trio.run(main)


def test_the_memory_budget_drops_a_client_that_takes_nothing_before_one_that_reads() -> None:
    """Past the response budget the writer whose client has taken nothing for longest goes: not the
    one that began writing first, if its client has read since (slowly, on a busy machine)."""
    import trio

    from unshardfs.http.server import Server, ServerLimits

    class Connection:  # what the budget touches of a connection
        def __init__(self) -> None:
            self.scope = trio.CancelScope()
            self.evicted = False

    async def main() -> None:
        server = Server(app=None, limits=ServerLimits(buffer_bytes=100))  # type: ignore[arg-type]
        reading, stalled, newest = Connection(), Connection(), Connection()
        server.open = 3
        server.hold(reading, 40)  # type: ignore[arg-type]
        server.hold(stalled, 40)  # type: ignore[arg-type]
        server.progressed(reading)  # type: ignore[arg-type]
        server.hold(newest, 40)  # type: ignore[arg-type]
        assert stalled.scope.cancel_called and not reading.scope.cancel_called and not newest.scope.cancel_called
        assert server.counters["dropped_for_memory"] == 1 and server.held == 80

    trio.run(main)


def test_deep_page_listings_leave_the_loop_to_readers() -> None:
    """Twenty clients asking for page 999,999,999 of a directory of a million entries, and one fetching a
    small file: the listings skip their way through every entry (the page lies past the end) while the
    file is answered. Counted, not timed: how many of the directory's batches of 1,024 entries the
    listings produce while the file's request is under way. A listing never gave the loop back while it
    skipped (no byte to send, nothing to wait for): the file waited for whole listings of a thousand
    batches each, one after another (9-10 s per chunk for a served million-entry directory under 20 such
    clients). Now each batch is a checkpoint, and at most `LISTINGS` listings run at once: a handful of
    batches go by while the file is answered."""
    import trio

    from unshardfs.http.app import LISTINGS, TreeApp
    from unshardfs.tree.nodes import EntryBatch

    made = [0]

    class Batch(EntryBatch):
        def node(self, i):
            return File(1, 0)

    class Big(DirNode):
        async def entries(self):
            for b in range(1000):
                made[0] += 1
                names = [f"{b}-{i}" for i in range(1024)]
                yield Batch(names, [1] * 1024, [None] * 1024, 0)

    class File(FileNode):
        async def read(self, offset, size):
            await trio.sleep(0)  # a read that waits (a cold page, a remote object)
            return b"x"[offset:offset + size]

    class Root(DirNode):
        async def lookup(self, name):
            return Big(0) if name == "big" else File(1, 0) if name == "f" else None

    app = TreeApp(Root(0), dict)

    async def get(path: str, query: bytes = b"") -> int:
        status = [0]

        async def send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await trio.sleep(0)  # a socket with room: the send still yields

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await app({"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "headers": [],
                   "query_string": query}, receive, send)
        return status[0]

    async def main() -> tuple[int, int]:
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(get, "/big/", b"page=999999999")
            await trio.sleep(0)
            await trio.sleep(0)  # the listings are under way
            before = made[0]
            assert await get("/f") == 200
            during = made[0] - before
            nursery.cancel_scope.cancel()
        return during, before

    during, before = trio.run(main)
    assert during <= 40 * LISTINGS, (during, before)  # before: 1,000 or more (whole listings)


def test_clients_that_stop_reading_their_listings_hold_no_turn() -> None:
    """Listings take turns (at most `LISTINGS` being made at once), but a turn is held while a piece of a
    listing is made, never while it is sent: more clients than there are turns, each taking the first
    piece of a long listing and then nothing, leave another client's listing to be answered whole."""
    import trio

    from unshardfs.http.app import LISTINGS, TreeApp

    class Big(DirNode):
        async def entries(self):
            for b in range(100):
                yield [(f"{b}-{i}", File(1, 0)) for i in range(1024)]

    class File(FileNode):
        async def read(self, offset, size):
            return b"x"[offset:offset + size]

    class Root(DirNode):
        async def lookup(self, name):
            return Big(0) if name == "big" else None

    app = TreeApp(Root(0), dict)
    stalled = trio.Event()  # never set: the stalled clients' sends never return

    async def get(path: str, query: bytes, stop_after: int | None) -> bytes:
        body = bytearray()
        pieces = 0

        async def send(message):
            nonlocal pieces
            if message["type"] == "http.response.body":
                pieces += 1
                body.extend(message["body"])
                if stop_after is not None and pieces > stop_after:
                    await stalled.wait()

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        await app({"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "headers": [],
                   "query_string": query}, receive, send)
        return bytes(body)

    async def main() -> bytes:
        async with trio.open_nursery() as nursery:
            for _ in range(LISTINGS + 2):
                nursery.start_soon(get, "/big/", b"format=json", 1)
            for _ in range(10):
                await trio.sleep(0)
            with trio.fail_after(30):
                got = await get("/big/", b"format=json", None)
            nursery.cancel_scope.cancel()
        return got

    listed = json.loads(trio.run(main))
    assert len(listed) == 100 * 1024
