"""Icechunk repositories written by the `icechunk` package, mounted: branch main's tree at the root and
every branch, tag and snapshot as `@NAME/`, each read back through the mount against icechunk's own read
of that version (every key byte for byte; the sharded array, shown unsharded, value for value); `diff -r`
between versions; a pinned version; virtual references outside the repository failing alone; `inspect`
listing the versions; `export` of a named version."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.support.icechunk_repos import Written, needs_icechunk, write_repo
from unshardfs.testing.mounts import run_cli
from unshardfs.testing.trees import exported_files

ts = pytest.importorskip("tensorstore")
pytestmark = needs_icechunk

OUTSIDE = ("virt/c/0/0", "virt/c/1/0")
SHARDED = "seg"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Written:
    return write_repo(tmp_path_factory.mktemp("icechunk"))


def _allow(repo: Written) -> tuple[str, str]:
    return ("--icechunk-virtual", f"file://{repo.external}/")


def _zarr(path: Path) -> np.ndarray:
    array = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, read=True).result()
    assert "sharding_indexed" not in str(array.codec.to_json())
    return array.read().result()


def _check_version(here: Path, repo: Written, version: str) -> int:
    """Every key icechunk serves for `version` is a file of the same bytes under `here` (the sharded array's
    keys excepted: it is shown unsharded, and compared value for value); returns the keys compared."""
    keys = repo.keys(version)
    compared = 0
    for key, value in keys.items():
        if key.startswith(SHARDED + "/"):
            continue
        assert (here / key).read_bytes() == value, f"@{version}/{key}"
        compared += 1
    for path, values in repo.arrays(version).items():
        if path == SHARDED:
            np.testing.assert_array_equal(_zarr(here / path), values, err_msg=f"@{version}/{path}")
    shown = {k for k in exported_files(here) if not k.startswith("@")}  # an export's own records aside
    assert {k for k in shown if not k.startswith(SHARDED + "/")} == {k for k in keys if not k.startswith(SHARDED + "/")}
    return compared


def test_every_version_is_a_directory_matching_icechunk(repo, mount):
    m = mount(repo.root, *_allow(repo))
    names = sorted(os.listdir(m.path))
    versions = repo.versions
    assert [n for n in names if n.startswith("@")] == sorted(f"@{v}" for v in versions)
    assert {"zarr.json", "img", "coords", "seg", "deep", "virt"} <= set(names)
    assert _check_version(m.path, repo, "branch.main") >= 20
    for name in versions:
        if name != "1CECHNKREP0F1RSTCMT0":
            assert _check_version(m.path / f"@{name}", repo, name) >= 10
    assert os.listdir(m.path / "@1CECHNKREP0F1RSTCMT0") == []  # the repository's first commit is empty
    # a version's directory is the tree that version shows at the root
    main = m.path / "@branch.main"
    assert subprocess.run(["diff", "-r", "-x", "@*", str(m.path), str(main)], capture_output=True,
                          timeout=60).returncode == 0
    # the tag and the snapshot it names are the same tree; main moved on from it
    tagged = m.path / f"@{versions['tag.v1']}"
    assert subprocess.run(["diff", "-r", str(m.path / "@tag.v1"), str(tagged)], capture_output=True,
                          timeout=60).returncode == 0
    diff = subprocess.run(["diff", "-rq", str(m.path / "@tag.v1"), str(main)], capture_output=True, text=True,
                          timeout=60)
    assert diff.returncode == 1 and "tiny" in diff.stdout and "seg/c/" in diff.stdout and "img" not in diff.stdout
    # the version directories say which version they are
    assert os.getxattr(m.path / "@tag.v1", "user.unshardfs.version") == b"tag.v1"


def test_outside_virtual_references_fail_alone(repo, mount):
    m = mount(repo.root)
    for key in OUTSIDE:
        assert (m.path / key).stat().st_size == 8
        with pytest.raises(OSError) as info:
            (m.path / key).read_bytes()
        assert info.value.errno == errno.EIO
    keys = repo.keys("branch.main")
    assert (m.path / "virt/c/2/0").read_bytes() == keys["virt/c/2/0"]  # inside the repository
    assert (m.path / "img/c/1/1").read_bytes() == keys["img/c/1/1"]  # the daemon is alive and exact
    assert m.stats()  # the daemon answers
    refused = [line for line in m.log_text().splitlines() if "outside the repository" in line]
    assert 1 <= len(refused) <= 2 and all(len(line) < 1000 for line in refused)


def test_a_pinned_version_shows_no_version_directories(repo, mount):
    m = mount(f"{repo.root}|icechunk:@tag.v1/|zarr3:", *_allow(repo))
    assert not [n for n in os.listdir(m.path) if n.startswith("@")]
    assert _check_version(m.path, repo, "tag.v1") >= 20
    m2 = mount(f"{repo.root}/|icechunk:@branch.dev/|zarr3:img/")
    assert (m2.path / "zarr.json").read_bytes() == repo.keys("branch.dev")["img/zarr.json"]
    np.testing.assert_array_equal(_zarr(m2.path), repo.arrays("branch.dev")["img"])


def test_inspect_lists_the_versions(repo):
    result = run_cli("inspect", str(repo.root))
    assert result.returncode == 0, result.stderr
    lines = [line.split() for line in result.stdout.splitlines() if line.strip().startswith("@")]
    assert [line[0] for line in lines[:3]] == ["@branch.dev", "@branch.main", "@tag.v1"]
    assert sorted(line[0][1:] for line in lines) == sorted(repo.versions)
    marks = {line[0]: " ".join(line[6:]) for line in lines}
    assert marks["@branch.main"] == "(shown)" and marks["@branch.dev"] == "(newest)"
    assert all(line[1].endswith("Z") for line in lines)
    pinned = run_cli("inspect", f"{repo.root}|icechunk:@tag.v1/")
    assert pinned.returncode == 0 and "@tag.v1 named: only it is shown" in pinned.stdout, pinned.stderr
    assert "seg/" in result.stdout


def test_wrong_versions_are_one_line_errors(repo):
    for url, message in ((f"{repo.root}|icechunk:@tag.v9/", "no tag.v9"),
                         (f"{repo.root}|icechunk:@yesterday/", "Icechunk version 'yesterday'"),
                         (f"{repo.root}|icechunk:@A0000000000000000000/", "missing"),
                         (f"{repo.root}|icechunk:@AAAAAAAAAAAAAAAAAAAA/", "nor a snapshot id"),
                         (f"{repo.root / 'chunks'}|icechunk:", "no branch main")):
        result = run_cli("inspect", url)
        assert result.returncode != 0 and message in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_export_writes_the_named_version_only(repo, tmp_path):
    for url, dest, version in ((str(repo.root), tmp_path / "main", "branch.main"),
                               (f"{repo.root}|icechunk:@tag.v1/", tmp_path / "v1", "tag.v1")):
        result = run_cli("export", url, str(dest), "--quiet", *_allow(repo), timeout=120)
        assert result.returncode == 0, result.stderr
        assert not [p for p in os.listdir(dest) if p.startswith("@")]
        _check_version(dest, repo, version)


def test_served_over_http_with_its_versions(repo):
    """`unshardfs serve` shows the same tree: branch main at the root, every version under `@NAME/`; the
    sharded array (unsharded) reads over HTTP as icechunk reads it, for the root and a tag."""
    import httpx

    from tests.support.served import served

    with served(str(repo.root), *_allow(repo)) as url:
        for version, prefix in (("branch.main", ""), ("tag.v1", "@tag.v1/"), ("branch.dev", "@branch.dev/")):
            keys = repo.keys(version)
            for key in ("zarr.json", "img/zarr.json", "img/c/1/1", "coords/c/0", "virt/c/0/0", "deep/er/arr/c/0/0"):
                reply = httpx.get(f"{url}/{prefix}{key}", timeout=30)
                assert reply.status_code == 200 and reply.content == keys[key], (version, key)
            shown = ts.open({"driver": "zarr3", "kvstore": f"{url}/{prefix}{SHARDED}/"}, read=True).result()
            np.testing.assert_array_equal(shown.read().result(), repo.arrays(version)[SHARDED], err_msg=version)
        assert httpx.get(f"{url}/@tag.v1/tiny/c/0", timeout=30).content == repo.keys("tag.v1")["tiny/c/0"]
        assert httpx.get(f"{url}/tiny/zarr.json", timeout=30).status_code == 404  # deleted on main


def test_mounted_over_http(repo, mount):
    """A plain HTTP server cannot list: branch main and every snapshot of its history are directories,
    each exact; the virtual references (file:// locations) fail alone."""
    from unshardfs.testing.http_servers import DatasetServer

    with DatasetServer(repo.root.parent) as srv:
        m = mount(f"{srv.url}/{repo.root.name}/|icechunk:|zarr3:")
        names = {n for n in os.listdir(m.path) if n.startswith("@")}
        main = repo.versions["branch.main"]
        assert "@branch.main" in names and f"@{main}" in names and "@tag.v1" not in names
        for here, version in ((m.path, "branch.main"), (m.path / f"@{repo.versions['tag.v1']}", "tag.v1")):
            keys = repo.keys(version)
            for key, value in keys.items():
                if key.startswith("virt/c/"):
                    with pytest.raises(OSError) as info:
                        (here / key).read_bytes()
                    assert info.value.errno == errno.EIO
                elif not key.startswith(SHARDED + "/"):
                    assert (here / key).read_bytes() == value, (version, key)
            np.testing.assert_array_equal(_zarr(here / SHARDED), repo.arrays(version)[SHARDED], err_msg=version)
