"""`unshardfs serve`: the mount's tree over HTTP, read by TensorStore, CloudVolume and zarr-python 2."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest

from tests.support.served import served
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.precomputed import Scale, read_all, sharding, write_objects, write_volume

REPO = Path(__file__).resolve().parents[2]
KEY = "1_1_1"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    volume = write_volume(root / "volume", [Scale((64, 64, 32), (16, 16, 8),
                                                  sharding(minishard=1, shard=2, data_enc="gzip"))], "uint16")
    skeletons = write_objects(root / "skeletons", "skeletons", sharding(minishard=1, shard=1, data_enc="gzip"))
    meshes = write_objects(root / "meshes", "mesh", sharding(preshift=1, minishard=1, shard=1, data_enc="gzip"))
    return {"volume": volume, "skeletons": skeletons, "meshes": meshes, "root": root}


def get(url: str, path: str, headers: dict | None = None, method: str = "GET") -> tuple[int, dict, bytes]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def walk(url: str, path: str = "/") -> list[str]:
    """Every file path under `path`, through the JSON listings."""
    status, _, body = get(url, path + "?format=json")
    assert status == 200, path
    out = []
    for item in json.loads(body):
        child = path + item["name"]
        out += walk(url, child + "/") if item["type"] == "directory" else [child]
    return out


def local_files(root: Path) -> list[str]:
    return sorted("/" + str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["volume", "skeletons", "meshes"])
def test_every_file_equals_the_unsharded_twin(site, kind):
    paths = site[kind]
    with served(str(paths["sharded"])) as url:
        files = sorted(walk(url))
        plain = [f for f in local_files(paths["plain"])]
        assert [f for f in files if not f.endswith("info")] == [f for f in plain if not f.endswith("info")]
        for f in files:
            status, headers, body = get(url, f)
            assert status == 200, f
            if not f.endswith("info"):
                assert body == (paths["plain"] / f[1:]).read_bytes(), f
            json_file = f.rsplit("/", 1)[-1] in ("info", "provenance")
            assert headers["content-type"] == ("application/json" if json_file else "application/octet-stream")


def test_tensorstore_and_cloudvolume_read_it(site):
    import tensorstore as ts
    from cloudvolume import CloudVolume

    with served(str(site["volume"]["sharded"])) as url:
        store = ts.open({"driver": "neuroglancer_precomputed", "kvstore": url + "/"}, read=True).result()
        np.testing.assert_array_equal(store.read().result(), read_all(site["volume"]["plain"]))
    with served(str(site["skeletons"]["sharded"])) as url:
        remote = CloudVolume(f"precomputed://{url}", progress=False, use_https=False)
        here = CloudVolume(f"file://{site['skeletons']['plain']}", progress=False)
        ids = sorted(int(p.name) for p in (site["skeletons"]["plain"] / "skeletons").iterdir() if p.name.isdigit())
        for segid in ids[:5]:
            assert remote.skeleton.get(segid) == here.skeleton.get(segid)


@pytest.mark.legacy
def test_zarr2_view_read_by_zarr_python_2_over_http(tmp_path):
    from unshardfs.testing.zarr import BYTES_LE, ZCase, codec, consolidate
    from unshardfs.testing.zarr import sharding as zsharding
    from unshardfs.testing.zarr import write_case, write_group

    zarr2 = REPO / ".venv-zarr2" / "bin" / "python"
    if not zarr2.exists():
        pytest.skip("needs .venv-zarr2 (scripts/setup makes it)")
    case = ZCase((40, 30), "uint16", (20, 15), [zsharding((10, 5), [BYTES_LE, codec("gzip", level=1)])], (10, 5),
                 [BYTES_LE, codec("gzip", level=1)])
    write_group(tmp_path / "sharded")
    data = write_case(tmp_path, "arr", case)
    consolidate(tmp_path / "sharded")
    np.save(tmp_path / "want.npy", data)
    script = ("import sys, numpy as np, zarr; g = zarr.open_consolidated(sys.argv[1], mode='r');"
              "np.testing.assert_array_equal(g['arr'][...], np.load(sys.argv[2])); print('ok')")
    with served(str(tmp_path / "sharded"), "--view", "zarr2") as url:
        result = subprocess.run([str(zarr2), "-c", script, url + "/", str(tmp_path / "want.npy")],
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


def test_ranges_validators_methods_and_cors(site):
    plain = site["volume"]["plain"] / KEY
    name = sorted(os.listdir(plain))[0]
    want = (plain / name).read_bytes()
    path = f"/{KEY}/{name}"
    with served(str(site["volume"]["sharded"])) as url:
        status, headers, body = get(url, path, {"Range": "bytes=10-19"})
        assert (status, body, headers["content-range"]) == (206, want[10:20], f"bytes 10-19/{len(want)}")
        assert get(url, path, {"Range": "bytes=-7"})[2] == want[-7:]
        assert get(url, path, {"Range": f"bytes={len(want) - 3}-"})[2] == want[-3:]
        assert get(url, path, {"Range": f"bytes=5-{len(want) + 100}"})[2] == want[5:]
        status, headers, _ = get(url, path, {"Range": f"bytes={len(want)}-"})
        assert status == 416 and headers["content-range"] == f"bytes */{len(want)}"
        assert get(url, path, {"Range": "bytes=0-1,5-6"})[:1] == (200,)  # multi-range: the whole file
        assert get(url, path, {"Range": "items=0-1"})[2] == want
        status, headers, body = get(url, path)
        assert headers["accept-ranges"] == "bytes" and headers["access-control-allow-origin"] == "*"
        assert get(url, path, {"If-None-Match": headers["etag"]})[0] == 304
        assert get(url, path, {"If-Modified-Since": headers["last-modified"]})[0] == 304
        assert get(url, path, {"If-Range": '"other"', "Range": "bytes=0-0"})[0] == 200
        status, headers, body = get(url, path, method="HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) == len(want)
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            status, headers, _ = get(url, path, method=method)
            assert status == 405 and "GET" in headers["allow"]
        status, headers, _ = get(url, path, {"Origin": "http://viewer.example", "Access-Control-Request-Method": "GET",
                                             "Access-Control-Request-Headers": "range"}, method="OPTIONS")
        assert status == 204 and "GET" in headers["access-control-allow-methods"]
        assert headers["access-control-allow-headers"] == "range"
        assert get(url, f"/{KEY}/0-16_0-16_0-7")[0] == 404  # a misaligned name: absent, as on the mount
        assert get(url, f"/{KEY}")[0] == 301
    with served(str(site["volume"]["sharded"]), "--cors-origin", "https://viewer.example") as url:
        assert get(url, path)[1]["access-control-allow-origin"] == "https://viewer.example"


def test_hostile_paths_and_headers_stay_inside(site, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(site["volume"]["sharded"], source)
    (tmp_path / "secret").write_text("secret")
    os.symlink(tmp_path / "secret", source / "link-out")
    with served(str(source)) as url:
        for path in ("/../secret", "/%2e%2e/secret", "/%2E%2E/%2E%2E/etc/passwd", f"/{KEY}/..%2F..%2Fsecret",
                     "/..%2fsecret", "/info%00", "/%ff", "/./info/../../secret"):
            status, _, body = get(url, path)
            assert status in (400, 404) and b"secret" not in body, path
        status, _, body = get(url, "/link-out")  # there, but refused: an error, never the outside's bytes
        assert status == 502 and b"secret" not in body
        parts = urlsplit(url)
        with socket.create_connection((parts.hostname, parts.port), timeout=10) as s:
            s.sendall(b"GET /info HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n")
            answer = s.recv(100)
        assert not answer.startswith(b"HTTP/1.1 200"), answer
        assert get(url, "/info")[0] == 200  # still serving


def test_many_clients_at_once(site):
    paths = site["volume"]["plain"]
    files = local_files(paths)
    with served(str(paths.parent / "sharded")) as url:
        def fetch(f: str) -> bool:
            status, _, body = get(url, f)
            return status == 200 and (f.endswith("info") or body == (paths / f[1:]).read_bytes())

        with ThreadPoolExecutor(64) as pool:
            assert all(pool.map(fetch, files * 4))
        result = run_cli("stats", url)
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)
        assert stats["http"]["requests"] >= len(files) * 4 and stats["source"]["reads"] > 0


def test_damage_is_502_and_the_rest_is_served(site, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(site["volume"]["sharded"], source)
    victim = sorted((source / KEY).glob("*.shard"))[0]
    victim.write_bytes(victim.read_bytes()[:-200] + bytes(200))  # payloads near the end garbled
    plain = site["volume"]["plain"] / KEY
    with served(str(source)) as url:
        statuses = {}
        for name in sorted(os.listdir(plain)):
            status, _, body = get(url, f"/{KEY}/{name}")
            statuses[name] = status
            if status == 200:
                assert body == (plain / name).read_bytes(), name
        assert 502 in statuses.values() and 200 in statuses.values(), statuses


def _exchange(url: str, data: bytes) -> bytes:
    """Everything the server sends back for `data` until it closes or goes quiet for a second."""
    parts = urlsplit(url)
    out = b""
    with socket.create_connection((parts.hostname, parts.port), timeout=1) as s:
        s.sendall(data)
        try:
            while chunk := s.recv(1 << 16):
                out += chunk
            out += b"<closed>"
        except socket.timeout:
            pass
    return out


def test_keep_alive_pipelining_and_request_bodies(site):
    get_info = b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n"
    with served(str(site["volume"]["sharded"])) as url:
        # Pipelined requests are answered in order on one connection, which stays open.
        answer = _exchange(url, get_info + b"HEAD /info HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer.count(b"HTTP/1.1 200 OK") == 2 and answer.count(b"HTTP/1.1 404 Not Found") == 1
        assert b"<closed>" not in answer and b"connection: close" not in answer.lower()
        # HTTP/1.0: answered, then closed.
        answer = _exchange(url, b"GET /info HTTP/1.0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"<closed>")
        # A small body is read and dropped, never taken for a request; a larger one is a 413 and the
        # connection ends. Upgrades are declined (answered as HTTP/1.1).
        for body in (b"Content-Length: 5\r\n\r\nabcde", b"Transfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n0\r\n\r\n"):
            answer = _exchange(url, b"GET /info HTTP/1.1\r\nHost: x\r\n" + body + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1 404 ") == 1, answer
            assert b"<closed>" not in answer
        for body in (b"Content-Length: 65537\r\n\r\nabcde", b"Transfer-Encoding: chunked\r\n\r\n10001\r\nabcde"):
            answer = _exchange(url, b"GET /info HTTP/1.1\r\nHost: x\r\n" + body)
            assert answer.startswith(b"HTTP/1.1 413 ") and answer.endswith(b"<closed>"), answer
        answer = _exchange(url, b"GET /info HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n" + get_info)
        assert answer.count(b"HTTP/1.1 200 OK") == 2
        assert _exchange(url, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        assert _exchange(url, b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
