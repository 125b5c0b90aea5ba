"""`serve` under hostile and merely big metadata: it keeps answering, its memory and log stay bounded.

A Zarr v3 store with four 24 MB `zarr.json` files (two with millions of
values, refused before they are parsed; two within the limits, parsed off
the event loop), one nested 600 deep, and twenty with a 900 KB chunk key encoding name.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.support.memory import MiB, peak_rss
from tests.support.served import get_body, served
from unshardfs.testing.mounts import daemon_pids

BIG = 24 << 20
ECHOES = 20


def array(**extra) -> dict:
    return {"zarr_format": 3, "node_type": "array", "shape": [8], "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [8]}},
            "codecs": [{"name": "bytes"}], "fill_value": 0, **extra}


def group_of(attributes: bytes) -> bytes:
    """A group zarr.json whose `attributes` member is the JSON text `attributes`."""
    return b'{"zarr_format": 3, "node_type": "group", "attributes": ' + attributes + b"}"


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile-meta")
    files = {"zarr.json": json.dumps({"zarr_format": 3, "node_type": "group"}).encode(),
             "ok/zarr.json": json.dumps(array()).encode(),
             "deep/zarr.json": json.dumps(array()).encode()[:-1] + b', "attributes": {"a": ' + b"[" * 600
             + b"]" * 600 + b"}}"}
    many_values = b'{"x": [' + b",".join([b"[0]"] * (BIG // 4)) + b"]}"  # 12,000,000 values
    name = "n" * 400
    strings = b'{"names": [' + b",".join([json.dumps(name).encode()] * (BIG // 403)) + b"]}"  # 62,000 values
    for i, attributes in enumerate([many_values, many_values, strings, strings]):
        files[f"big{i}/zarr.json"] = group_of(attributes)
    for i in range(ECHOES):
        files[f"echo{i}/zarr.json"] = json.dumps(array(chunk_key_encoding={"name": f"{i}" + "c" * 900_000})).encode()
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root


def get(url: str, path: str) -> tuple[int, bytes]:
    return get_body(url, path, timeout=120)


def test_answers_while_big_metadata_is_parsed(store, tmp_path):
    """Four 24 MB zarr.json files requested at once: another file keeps answering within 2 s
    (on the code that parsed on the event loop: several seconds), and the server's peak memory
    grows by less than 110 MiB (on that code: ~800 MB)."""
    with served(str(store), log=tmp_path / "serve.log") as url:
        (pid,) = daemon_pids(store)
        for _ in range(3):
            assert get(url, "/ok/zarr.json") == (200, (store / "ok/zarr.json").read_bytes())
        baseline = peak_rss(pid) / MiB
        results: dict[int, tuple[int, int]] = {}

        def fetch(i: int) -> None:
            status, body = get(url, f"/big{i}/zarr.json")
            results[i] = status, len(body)

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        slowest, answered = 0.0, 0
        deadline = time.monotonic() + 240
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
            start = time.monotonic()
            assert get(url, "/ok/zarr.json")[0] == 200
            slowest = max(slowest, time.monotonic() - start)
            answered += 1
            time.sleep(0.02)
        for t in threads:
            t.join(timeout=60)
        peak = peak_rss(pid) / MiB
    # Each big file is a valid group: shown unchanged, whole, however its attributes look.
    assert results == {i: (200, (store / f"big{i}/zarr.json").stat().st_size) for i in range(4)}
    assert answered >= 3 and slowest < 2.0, f"slowest answer {slowest:.2f} s of {answered}"
    assert peak - baseline < 110, f"peak {peak:.0f} MiB after a baseline of {baseline:.0f} MiB"


def test_deep_nesting_is_not_a_500(store, tmp_path):
    """A child zarr.json nested 600 deep is shown unchanged (on the older code: 500)."""
    log = tmp_path / "serve.log"
    with served(str(store), log=log) as url:
        assert get(url, "/deep/zarr.json") == (200, (store / "deep/zarr.json").read_bytes())
    text = log.read_text()
    assert "Traceback" not in text and "deep/zarr.json: is nested more than" in text, text[-3000:]


def test_log_stays_small_under_echoing_metadata(store, tmp_path):
    """Twenty zarr.json files with a 900 KB chunk key encoding name, each requested three times: the log
    says why each is shown unchanged in one short line (on the older code: 18 MB of log)."""
    log = tmp_path / "serve.log"
    with served(str(store), log=log) as url:
        for _ in range(3):
            for i in range(ECHOES):
                assert get(url, f"/echo{i}/zarr.json")[0] == 200
    lines = [line for line in log.read_text().splitlines() if "echo" in line]
    assert len(lines) == ECHOES, lines[:3]
    assert log.stat().st_size < ECHOES * 1200, f"{log.stat().st_size:,} bytes of log"
