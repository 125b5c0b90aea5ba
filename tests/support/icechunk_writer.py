"""Writes Icechunk repositories and dumps icechunk's own reads of them (run by .venv-icechunk/bin/python, as
its own process: the icechunk package pins its own zarr-python).

    icechunk_writer.py write ROOT EXTERNAL   a repository of several commits, a branch and a tag
    icechunk_writer.py dump ROOT OUT         OUT/versions.json; OUT/<version>/keys.json (key -> hex bytes)
                                             and OUT/<version>/<array path>.npy, for every version
    icechunk_writer.py checksums ROOT URL ETAG LAST_MODIFIED LOCAL
                                             virtual references with checksums (see `checksums`)

The repository: a root group (attributes), `img` (uint16, random: native chunks), `coords` (inline chunks),
`seg` (a sharded Zarr v3 array: each shard is one chunk object), `split` (its references in several
manifests, split by chunk rows), `scalar` (0-d), a nested `deep/er/arr`, and `virt`, whose
chunks are virtual references into EXTERNAL/data.bin (one more points inside the repository). Commits on
main: create; overwrite a region and add `tiny`; delete `tiny` and rewrite part of `seg`. Tag `v1` names
the second commit; branch `dev` starts at the first and has a commit of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import datetime, timedelta, timezone

import icechunk
import numpy as np
import zarr
import zarr.errors
from zarr.core.buffer import default_buffer_prototype


def _repo(root: str, external: str, create: bool) -> icechunk.Repository:
    """The repository with two virtual chunk containers: EXTERNAL (outside it) and the repository itself."""
    config = icechunk.RepositoryConfig.default()
    config.inline_chunk_threshold_bytes = 64
    # `split`'s chunk references spread over one manifest per two chunk rows
    config.manifest = icechunk.ManifestConfig(splitting=icechunk.ManifestSplittingConfig.from_dict(
        {icechunk.ManifestSplitCondition.name_matches("split"): {icechunk.ManifestSplitDimCondition.Axis(0): 2}}))
    places = {f"file://{external}/": external, f"file://{root}/": root}
    for prefix, path in places.items():
        config.set_virtual_chunk_container(icechunk.VirtualChunkContainer(prefix, icechunk.local_filesystem_store(path)))
    storage = icechunk.local_filesystem_storage(root)
    credentials: dict[str, None] = dict.fromkeys(places)
    opener = icechunk.Repository.create if create else icechunk.Repository.open
    return opener(storage, config=config, authorize_virtual_chunk_access=credentials)


def write(root: str, external: str) -> None:
    os.makedirs(external, exist_ok=True)
    with open(f"{external}/data.bin", "wb") as f:
        f.write(bytes(range(256)) * 64)
    repo = _repo(root, external, create=True)
    with open(f"{root}/inside.bin", "wb") as f:  # an object inside the repository a virtual reference names
        f.write(b"0123456789abcdefghij")
    rng = np.random.default_rng(7)
    s = repo.writable_session("main")
    g = zarr.group(store=s.store, attributes={"title": "icechunk test", "n": 1})
    img = g.create_array("img", shape=(96, 80), chunks=(32, 32), dtype="uint16", fill_value=0)
    img[:] = rng.integers(0, 60000, size=(96, 80), dtype="uint16")
    coords = g.create_array("coords", shape=(10,), chunks=(4,), dtype="int16", fill_value=0, compressors=None)
    coords[:] = np.arange(10, dtype="int16")
    seg = g.create_array("seg", shape=(64, 64, 32), chunks=(16, 16, 16), shards=(32, 32, 32), dtype="uint32",
                         fill_value=0)
    seg[:] = rng.integers(0, 50, size=(64, 64, 32), dtype="uint32")
    split = g.create_array("split", shape=(96, 80), chunks=(16, 32), dtype="uint16", fill_value=0)
    split[:] = rng.integers(0, 60000, size=(96, 80), dtype="uint16")
    g.create_array("scalar", shape=(), dtype="float64", fill_value=0)[...] = 3.5  # its one chunk key: `c`
    deep = g.create_group("deep").create_group("er", attributes={"depth": 2})
    deep.create_array("arr", shape=(5, 5), chunks=(5, 5), dtype="float32", fill_value=0)[:] = np.eye(5)
    virt = g.create_array("virt", shape=(3, 8), chunks=(1, 8), dtype="uint8", fill_value=0, compressors=None)
    s.store.set_virtual_ref("virt/c/0/0", f"file://{external}/data.bin", offset=16, length=8)
    # with a checksum: the object's modification time, which must not be later when read
    s.store.set_virtual_ref("virt/c/1/0", f"file://{external}/data.bin", offset=300, length=8,
                            checksum=datetime.now(timezone.utc) + timedelta(days=1))
    s.store.set_virtual_ref("virt/c/2/0", f"file://{root}/inside.bin", offset=3, length=8)
    assert virt.shape == (3, 8)
    first = s.commit("create")

    s = repo.writable_session("main")
    g = zarr.open_group(store=s.store)
    g["img"][10:50, 5:40] = 7
    g["split"][40:60, :] = 5
    tiny = g.create_array("tiny", shape=(4,), chunks=(2,), dtype="uint8", fill_value=0)
    tiny[:] = [1, 2, 3, 4]
    second = s.commit("region and tiny")
    repo.create_tag("v1", second)

    s = repo.writable_session("main")
    g = zarr.open_group(store=s.store)
    del g["tiny"]
    g["seg"][0:20, 0:40, 8:24] = 99
    g.attrs["n"] = 3
    s.commit("delete tiny, rewrite seg")

    repo.create_branch("dev", first)
    s = repo.writable_session("dev")
    zarr.open_group(store=s.store)["img"][0:8, 0:8] = 1234
    s.commit("dev work")


async def _keys(store: icechunk.IcechunkStore) -> dict[str, str]:
    out: dict[str, str] = {}
    async for key in store.list():
        buf = await store.get(key, prototype=default_buffer_prototype())
        if buf is not None:
            out[key] = buf.to_bytes().hex()
    return out


def dump(root: str, out: str, external: str) -> None:
    repo = _repo(root, external, create=False)
    versions: dict[str, str] = {}
    for branch in sorted(repo.list_branches()):
        versions[f"branch.{branch}"] = repo.lookup_branch(branch)
    for tag in sorted(repo.list_tags()):
        versions[f"tag.{tag}"] = repo.lookup_tag(tag)
    for branch in sorted(repo.list_branches()):
        for info in repo.ancestry(branch=branch):
            versions[info.id] = info.id
    with open(f"{out}/versions.json", "w") as f:
        json.dump(versions, f)
    for name, snapshot in versions.items():
        store = repo.readonly_session(snapshot_id=snapshot).store
        here = f"{out}/{name}"
        os.makedirs(here, exist_ok=True)
        with open(f"{here}/keys.json", "w") as f:
            json.dump(asyncio.run(_keys(store)), f)
        try:
            group = zarr.open_group(store=store, mode="r")
        except zarr.errors.GroupNotFoundError:  # the repository's first, empty snapshot
            continue
        for path, array in _arrays(group):
            np.save(f"{here}/{path.replace('/', '.')}.npy", array[...])


def _arrays(group: zarr.Group, prefix: str = "") -> list[tuple[str, zarr.Array]]:
    found: list[tuple[str, zarr.Array]] = []
    for name, member in group.members():
        path = prefix + name
        if isinstance(member, zarr.Array):
            found.append((path, member))
        else:
            found += _arrays(member, path + "/")
    return found


def checksums(root: str, url: str, etag: str, last_modified: str, local: str) -> None:
    """A repository whose array `v` (5 x 8 uint8, a chunk per row) holds virtual references into the object
    at URL, each row 8 bytes further in: row 0 with the ETag checksum ETAG as the server gives it (quoted),
    row 1 with it unquoted, row 2 with the modification time LAST_MODIFIED (seconds since the epoch) as
    checksum, row 3 with none, row 4 with the weak form `W/ETAG`; and array `w` (1 x 8), one reference
    into the local file LOCAL with the ETag object-store clients give a local file."""
    prefix = url.rsplit("/", 1)[0] + "/"
    folder = os.path.dirname(local) + "/"
    config = icechunk.RepositoryConfig.default()
    config.set_virtual_chunk_container(icechunk.VirtualChunkContainer(prefix, icechunk.http_store()))
    config.set_virtual_chunk_container(icechunk.VirtualChunkContainer(f"file://{folder}",
                                                                      icechunk.local_filesystem_store(folder)))
    repo = icechunk.Repository.create(icechunk.local_filesystem_storage(root), config=config,
                                      authorize_virtual_chunk_access={prefix: None, f"file://{folder}": None})
    s = repo.writable_session("main")
    g = zarr.group(store=s.store)
    g.create_array("v", shape=(5, 8), chunks=(1, 8), dtype="uint8", fill_value=0, compressors=None)
    g.create_array("w", shape=(1, 8), chunks=(1, 8), dtype="uint8", fill_value=0, compressors=None)
    when = datetime.fromtimestamp(int(last_modified), timezone.utc)
    for row, checksum in enumerate([etag, etag.strip('"'), when, None, f"W/{etag}"]):
        s.store.set_virtual_ref(f"v/c/{row}/0", url, offset=16 + 8 * row, length=8, checksum=checksum)
    st = os.stat(local)
    tag = f"{st.st_ino:x}-{st.st_mtime_ns // 1000:x}-{st.st_size:x}"
    s.store.set_virtual_ref("w/c/0/0", f"file://{local}", offset=4, length=8, checksum=tag)
    s.commit("virtual references with checksums")


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "checksums":
        checksums(*sys.argv[2:7])
    else:
        dump(sys.argv[2], sys.argv[3], sys.argv[4])
