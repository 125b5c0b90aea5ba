"""export into object storage (s3:// against moto's server, gs:// against a fake of the JSON API):
the objects equal a local export byte for byte, the ledger and manifest live under the prefix,
`--resume` and `check --manifest` work against them, and a store that fails, refuses or lies
stops the export with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import crc32c
import httpx
import pytest

from tests.support.objectstores import Fault, FakeGcs, FaultyProxy
from tests.support.s3 import CREDENTIALS, moto_s3
from unshardfs.dest.store import SinkOptions, StoreError, open_store
from unshardfs.testing.mounts import UNSHARDFS, run_cli
from unshardfs.util.backoff import Backoff
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.trees import exported_files

PREFIX = "copy"
MANIFEST = f"{PREFIX}/.unshardfs/manifest.jsonl"


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """64 chunk files of 1 KiB in 4 shards, 8 plain files and the info."""
    root = tmp_path_factory.mktemp("objvol")
    paths = write_volume(root, [Scale((32, 32, 32), (8, 8, 8), sharding(minishard=1, shard=2)),
                                Scale((16, 16, 16), (8, 8, 8), None, resolution=(2, 2, 2))], "uint16")
    return Path(paths["sharded"])


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """512 chunk files of 1 KiB in shards, 64 plain files and the info: enough to kill a run midway."""
    root = tmp_path_factory.mktemp("objmany")
    paths = write_volume(root, [Scale((64, 64, 64), (8, 8, 8), sharding(minishard=2, shard=2)),
                                Scale((32, 32, 32), (8, 8, 8), None, resolution=(2, 2, 2))], "uint16")
    return Path(paths["sharded"])


@pytest.fixture(scope="module")
def big_volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two plain chunks of 16 MiB (more than one PUT: uploaded in parts) beside small sharded ones."""
    root = tmp_path_factory.mktemp("objbig")
    paths = write_volume(root, [Scale((16, 16, 16), (8, 8, 8), sharding(minishard=1, shard=1)),
                                Scale((256, 256, 256), (256, 256, 128), None, resolution=(2, 2, 2))], "uint16")
    return Path(paths["sharded"])


def _reference(source: Path, dest: Path) -> dict[str, bytes]:
    result = run_cli("export", "-q", str(source), str(dest), timeout=180)
    assert result.returncode == 0, result.stderr
    return {rel: path.read_bytes() for rel, path in exported_files(dest).items()}


@pytest.fixture(scope="module")
def reference(volume: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _reference(volume, tmp_path_factory.mktemp("objref") / "out")


@pytest.fixture(scope="module")
def many_reference(many: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _reference(many, tmp_path_factory.mktemp("objmanyref") / "out")


@pytest.fixture(scope="module")
def big_reference(big_volume: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return _reference(big_volume, tmp_path_factory.mktemp("objbigref") / "out")


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Any:
    """(endpoint behind a fault-injecting proxy, boto3 client of moto) with bucket "out"."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with moto_s3() as (endpoint, client), FaultyProxy(endpoint) as proxy:
        httpx.post(f"{endpoint}/moto-api/reset")  # moto's buckets live in the process, not in one server
        client.create_bucket(Bucket="out")
        yield proxy, client


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    # No Google credentials from the machine: requests to the fake are anonymous.
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "none.json"))
    with FakeGcs(("bkt",)) as fake:
        yield fake


def s3_objects(client: Any, bucket: str = "out", prefix: str = PREFIX) -> dict[str, bytes]:
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for item in page.get("Contents", []):
            found[item["Key"]] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
    return found


def data_of(objects: dict[str, bytes], prefix: str = PREFIX) -> dict[str, bytes]:
    """The exported files among `objects` (keyed by path below the prefix), the ledger aside."""
    return {key[len(prefix) + 1:]: data for key, data in objects.items()
            if not key.startswith(f"{prefix}/.unshardfs/")}


def unshardfs(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout)


def s3_export(proxy: FaultyProxy, source: Path, *options: str, dest: str = f"s3://out/{PREFIX}/") -> Any:
    return unshardfs("export", "-q", "--s3-endpoint", proxy.endpoint, "--backoff", "0.01", *options,
                     str(source), dest)


def s3_check(proxy: FaultyProxy, *options: str) -> Any:
    return unshardfs("check", "--s3-endpoint", proxy.endpoint, *options, "--manifest",
                     f"s3://out/{MANIFEST}", f"s3://out/{PREFIX}")


def kill_when(command: list[str], landed: Callable[[], bool], in_flight: Callable[[], int]) -> None:
    """Run `command`, SIGKILL it once `landed()`, then wait until the store handles no request: one it
    had received before the kill still lands, and what DEST holds is known only after."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not landed():
            assert child.poll() is None and time.monotonic() < deadline, "the export ended before it was killed"
            time.sleep(0.01)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(30)
    deadline = time.monotonic() + 30
    while in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)


def manifest_records(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in raw.decode().splitlines()[1:]]


def one_stop_line(result: Any) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0].startswith("unshardfs: "), lines
    return lines[0]


# ---- S3 ----------------------------------------------------------------------------------------------


def test_s3_export_equals_a_local_export_and_verifies(s3, volume, reference, tmp_path):
    proxy, client = s3
    result = s3_export(proxy, volume, "--jobs", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"manifest s3://out/{MANIFEST}")
    objects = s3_objects(client)
    assert data_of(objects) == reference
    records = manifest_records(objects[MANIFEST])
    assert sorted(r["path"] for r in records) == sorted(reference)
    # Every data PUT was a conditional create carrying the body's MD5 and CRC-32C.
    puts = [headers for method, path, status, headers in proxy.answered
            if method == "PUT" and "/.unshardfs/" not in path]
    assert len(puts) == len(reference)
    assert all(h.get("If-None-Match") == "*" and "Content-MD5" in h and "x-amz-checksum-crc32c" in h for h in puts)
    checked = s3_check(proxy, "--jobs", "3")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip().splitlines() == [
        f"s3://out/{PREFIX} matches its manifest: {len(reference):,} files checked, "
        f"{sum(map(len, reference.values())):,} bytes verified; 0 missing, 0 differing, 0 extra"]
    # The manifest says what a local export's says (same paths, checksums, mtimes, sources).
    local = tmp_path / "local"
    assert unshardfs("export", "-q", str(volume), str(local)).returncode == 0
    ours, theirs = objects[MANIFEST].splitlines(), (local / ".unshardfs" / "manifest.jsonl").read_bytes().splitlines()
    assert ours[0] == theirs[0] and sorted(ours[1:]) == sorted(theirs[1:])  # files land in any order
    again = s3_export(proxy, volume)
    assert "holds an export of" in one_stop_line(again)


def test_s3_check_manifest_names_every_difference(s3, volume, reference):
    proxy, client = s3
    assert s3_export(proxy, volume).returncode == 0
    names = sorted(reference)
    client.delete_object(Bucket="out", Key=f"{PREFIX}/{names[0]}")
    client.put_object(Bucket="out", Key=f"{PREFIX}/{names[1]}", Body=bytes(len(reference[names[1]])))
    client.put_object(Bucket="out", Key=f"{PREFIX}/{names[2]}", Body=b"abc")
    client.put_object(Bucket="out", Key=f"{PREFIX}/2_2_2/stray", Body=b"x")
    said = {r["path"]: r["crc32c"] for r in manifest_records(client.get_object(Bucket="out", Key=MANIFEST)["Body"].read())}
    zeros = f"{crc32c.crc32c(bytes(len(reference[names[1]]))):08x}"
    result = s3_check(proxy)
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert sorted(lines[:-1]) == sorted([
        f"missing: {names[0]}",
        f"differs: {names[1]}: crc32c {zeros}, the manifest says {said[names[1]]}",
        f"differs: {names[2]}: 3 bytes, the manifest says {len(reference[names[2]]):,}",
        "extra: 2_2_2/stray"])
    assert lines[-1].startswith(f"s3://out/{PREFIX} DIFFERS from its manifest: {len(reference):,} files checked")
    assert lines[-1].endswith("1 missing, 2 differing, 1 extra")


@pytest.mark.slow
def test_s3_resume_after_the_client_is_killed_rewrites_no_complete_file(s3, many, many_reference):
    proxy, client = s3
    volume, reference = many, many_reference
    proxy.delay = 0.01
    command = [*UNSHARDFS, "export", "-q", "--jobs", "2", "--s3-endpoint", proxy.endpoint, str(volume),
               f"s3://out/{PREFIX}/"]
    kill_when(command, lambda: sum(1 for a in list(proxy.answered) if a[0] == "PUT" and a[2] == 200) >= 100,
              lambda: proxy.in_flight)
    before = set(data_of(s3_objects(client)))
    assert 0 < len(before) < len(reference)
    assert f"{PREFIX}/.unshardfs/manifest.jsonl" not in s3_objects(client)
    proxy.delay = 0.0
    proxy.answered.clear()
    resumed = s3_export(proxy, volume, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    # Counted as written: exactly the files that were not in DEST.
    assert f"({len(reference) - len(before):,} written, {len(before):,} already complete" in resumed.stdout
    # A file already complete was never written again: every PUT to one was refused (412) or not sent.
    rewritten = [path for method, path, status, _ in proxy.answered
                 if method == "PUT" and status == 200 and path.split(f"/{PREFIX}/", 1)[1] in before]
    assert rewritten == []
    objects = s3_objects(client)
    assert data_of(objects) == reference
    records = manifest_records(objects[MANIFEST])
    assert sorted(r["path"] for r in records) == sorted(reference)  # each file once
    assert s3_check(proxy).returncode == 0


@pytest.mark.slow
def test_s3_export_and_check_on_a_dask_cluster(s3, volume, reference):
    pytest.importorskip("distributed")
    proxy, client = s3
    result = s3_export(proxy, volume, "--scheduler", "local:2")
    assert result.returncode == 0, result.stderr
    assert data_of(s3_objects(client)) == reference
    checked = s3_check(proxy, "--scheduler", "local:2")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert " 0 missing, 0 differing, 0 extra" in checked.stdout


@pytest.mark.slow
def test_s3_big_files_go_in_parts_and_a_failed_part_leaves_nothing(s3, big_volume, big_reference):
    proxy, client = s3
    big = sorted(rel for rel, data in big_reference.items() if len(data) > 8 << 20)
    assert len(big) == 2
    proxy.faults.rules.append(Fault("PUT", "partNumber=2", 403, times=1))
    failed = s3_export(proxy, big_volume, "--jobs", "1")
    line = one_stop_line(failed)
    assert line.startswith("unshardfs: export stopped: cannot write 2_2_2/") and "HTTP 403" in line, line
    named = line.removeprefix("unshardfs: export stopped: cannot write ").split(":")[0]
    assert named in big
    assert f"{PREFIX}/{named}" not in s3_objects(client)
    assert client.list_multipart_uploads(Bucket="out").get("Uploads", []) == []  # aborted
    resumed = s3_export(proxy, big_volume, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert data_of(s3_objects(client)) == big_reference
    assert any("uploadId=" in path for method, path, _, _ in proxy.answered if method == "POST")
    assert s3_check(proxy).returncode == 0


def test_s3_unfinished_uploads_are_aborted_by_resume(s3, volume):
    proxy, client = s3
    started = client.create_multipart_upload(Bucket="out", Key=f"{PREFIX}/1_1_1/left-by-a-killed-worker")
    client.create_multipart_upload(Bucket="out", Key="elsewhere/not-ours")
    assert s3_export(proxy, volume, "--resume").returncode == 0
    left = client.list_multipart_uploads(Bucket="out").get("Uploads", [])
    assert [u["Key"] for u in left] == ["elsewhere/not-ours"] and started["UploadId"] not in str(left)


@pytest.mark.parametrize("fault, expected", [
    (Fault("PUT", "/1_1_1/", 503), "(after 3 attempts)"),
    (Fault("PUT", "/1_1_1/", "reset"), "(after 3 attempts)"),
    (Fault("PUT", "/1_1_1/", 403), "HTTP 403 Injected403"),
    (Fault("PUT", "/1_1_1/", "lie"), "the store answers ETag"),
])
def test_s3_failing_refusing_or_lying_store_stops_with_one_line_and_resume_completes(s3, volume, reference,
                                                                                     fault, expected):
    proxy, client = s3
    proxy.faults.rules.append(fault)
    stopped = s3_export(proxy, volume, "--retries", "2", "--jobs", "1")
    line = one_stop_line(stopped)
    assert line.startswith("unshardfs: export stopped: cannot write 1_1_1/") and expected in line, line
    assert "tasks complete (run again with --resume)" in stopped.stdout
    proxy.faults.rules.clear()
    resumed = s3_export(proxy, volume, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert data_of(s3_objects(client)) == reference
    assert s3_check(proxy).returncode == 0


def test_s3_transient_failures_are_retried(s3, volume, reference):
    proxy, client = s3
    proxy.faults.rules += [Fault("PUT", "/1_1_1/", 503, times=3), Fault("PUT", "/2_2_2/", "reset", times=3)]
    result = s3_export(proxy, volume)
    assert result.returncode == 0, result.stderr
    assert data_of(s3_objects(client)) == reference


def test_s3_operator_mistakes_are_one_line_before_any_write(s3, volume, tmp_path):
    proxy, client = s3
    missing = s3_export(proxy, volume, dest="s3://no-such-bucket/x/")
    assert "no-such-bucket does not exist" in one_stop_line(missing)
    proxy.faults.rules.append(Fault("GET", "/out/", 403))
    refused = s3_export(proxy, volume)
    assert "no permission to list it" in one_stop_line(refused)
    proxy.faults.rules.clear()
    proxy.answered.clear()
    escaping = s3_export(proxy, volume, dest="s3://out/a/../b/")
    assert "'..'" in one_stop_line(escaping) or ".." in escaping.stderr
    assert proxy.answered == []
    # A manifest whose paths leave DEST is refused whole, before anything is read through it.
    header = {"format": "unshardfs-manifest", "version": 1, "source": "x", "files": 1, "bytes": 1, "checksum": "crc32c"}
    line = {"path": "../outside", "size": 1, "crc32c": "00000000", "mtime_ns": 0}
    client.put_object(Bucket="out", Key="evil/manifest.jsonl", Body=(json.dumps(header) + "\n" + json.dumps(line)).encode())
    checked = unshardfs("check", "--s3-endpoint", proxy.endpoint, "--manifest", "s3://out/evil/manifest.jsonl",
                        f"s3://out/{PREFIX}")
    assert "line 2: bad path '../outside'" in one_stop_line(checked)


def test_keys_that_leave_the_prefix_are_never_requested():
    store = open_store("s3://out/copy", SinkOptions(endpoint="http://127.0.0.1:9", retrying=Backoff(retries=0)))
    try:
        for rel in ("../x", "a/../../x", "a//b", "a\0b", "x" * 1100):
            with pytest.raises(StoreError, match="not requested"):
                store.put(rel, b"data")
    finally:
        store.close()


# ---- GCS ---------------------------------------------------------------------------------------------


def gs_export(fake: FakeGcs, source: Path, *options: str) -> Any:
    return unshardfs("export", "-q", "--gcs-endpoint", fake.endpoint, "--backoff", "0.01", *options, str(source),
                     f"gs://bkt/{PREFIX}/")


def gs_check(fake: FakeGcs, *options: str) -> Any:
    return unshardfs("check", "--gcs-endpoint", fake.endpoint, *options, "--manifest", f"gs://bkt/{MANIFEST}",
                     f"gs://bkt/{PREFIX}")


def test_gcs_export_equals_a_local_export_and_verifies_from_the_stores_checksums(gcs, volume, reference):
    result = gs_export(gcs, volume, "--jobs", "4")
    assert result.returncode == 0, result.stderr
    assert data_of(gcs.objects()) == reference
    uploads = [path for method, path in gcs.faults.seen if method == "POST" and "/.unshardfs/" not in path
               and "%2F.unshardfs%2F" not in path]
    assert len(uploads) == len(reference) and all("ifGenerationMatch=0" in p for p in uploads)
    gcs.faults.seen.clear()
    checked = gs_check(gcs, "--jobs", "2")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # Verified from the store's own CRC-32C: no object's bytes were downloaded but the manifest's.
    media = [p for m, p in gcs.faults.seen if "alt=media" in p and "manifest.jsonl" not in p]
    assert media == []
    gcs.put("bkt", f"{PREFIX}/{sorted(reference)[3]}", b"changed")
    assert "differs: " in gs_check(gcs).stdout


@pytest.mark.slow
def test_gcs_big_files_use_resumable_uploads_and_planted_objects_are_replaced_only_when_different(
        gcs, big_volume, big_reference):
    names = sorted(big_reference)
    same, other = names[0], names[1]
    gcs.put("bkt", f"{PREFIX}/{same}", big_reference[same])
    gcs.put("bkt", f"{PREFIX}/{other}", b"planted by someone else")
    kept = gcs.buckets["bkt"][f"{PREFIX}/{same}"].generation
    result = gs_export(gcs, big_volume)
    assert result.returncode == 0, result.stderr
    assert f"({len(big_reference) - 1:,} written, 1 already complete" in result.stdout
    assert data_of(gcs.objects()) == big_reference
    assert gcs.buckets["bkt"][f"{PREFIX}/{same}"].generation == kept  # never rewritten
    assert any("uploadType=resumable" in p for m, p in gcs.faults.seen if m == "POST")
    assert gcs.sessions == {}
    assert gs_check(gcs).returncode == 0


@pytest.mark.slow
def test_gcs_resume_after_the_client_is_killed_rewrites_no_complete_file(gcs, many, many_reference):
    """As on S3: a client killed mid-export leaves only complete objects (each upload is one
    request with ifGenerationMatch=0), and --resume writes exactly the rest, never again an object
    already complete (its generation is unchanged)."""
    gcs.delay = 0.01
    command = [*UNSHARDFS, "export", "-q", "--jobs", "2", "--gcs-endpoint", gcs.endpoint, "--backoff", "0.01",
               str(many), f"gs://bkt/{PREFIX}/"]
    kill_when(command, lambda: len(data_of(gcs.objects())) >= 100, lambda: gcs.in_flight)
    gcs.delay = 0.0
    before = {name: o.generation for name, o in gcs.buckets["bkt"].items()
              if name.startswith(f"{PREFIX}/") and "/.unshardfs/" not in name}
    assert 0 < len(before) < len(many_reference)
    assert MANIFEST not in gcs.objects()
    resumed = gs_export(gcs, many, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"({len(many_reference) - len(before):,} written, {len(before):,} already complete" in resumed.stdout
    assert all(gcs.buckets["bkt"][name].generation == generation for name, generation in before.items())
    assert data_of(gcs.objects()) == many_reference
    records = manifest_records(gcs.objects()[MANIFEST])
    assert sorted(r["path"] for r in records) == sorted(many_reference)
    assert gs_check(gcs).returncode == 0


@pytest.mark.parametrize("fault, expected", [
    (Fault("POST", "1_1_1", "lie"), "the store states crc32c"),
    (Fault("POST", "1_1_1", "flip"), "HTTP 400 Provided CRC32C does not match"),
    (Fault("POST", "1_1_1", 500), "(after 3 attempts)"),
])
def test_gcs_lying_or_failing_store_stops_with_one_line_and_resume_completes(gcs, volume, reference, fault,
                                                                             expected):
    gcs.faults.rules.append(fault)
    stopped = gs_export(gcs, volume, "--retries", "2", "--jobs", "1")
    line = one_stop_line(stopped)
    assert line.startswith("unshardfs: export stopped: cannot write 1_1_1/") and expected in line, line
    gcs.faults.rules.clear()
    resumed = gs_export(gcs, volume, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert data_of(gcs.objects()) == reference
    assert gs_check(gcs).returncode == 0
