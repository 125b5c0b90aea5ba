"""`serve` while shards are replaced: a response is one version of a file, whole, or cut."""

from __future__ import annotations

import os
import shutil

import trio

from unshardfs.app.opened import OpenedSource
from unshardfs.http.app import PIECE, TreeApp
from unshardfs.testing.precomputed import Scale, sharding, write_volume

KEY = "1_1_1"


def test_a_shard_replaced_mid_response_cuts_it_never_mixes_versions(tmp_path):
    """Raw 2 MiB chunks (two body pieces): the shards are replaced by another version of the same
    geometry after the first piece went out. The second piece came from the new version (re-resolved
    as a new request may be): one 200 of old and new bytes under the old ETag."""
    scales = [Scale((256, 256, 128), (128, 128, 128), sharding(minishard=1, shard=1))]
    old, new = (write_volume(tmp_path / f"v{i}", scales, "uint8", seed=10 * i) for i in range(2))
    src = tmp_path / "src"
    shutil.copytree(old["sharded"], src)
    name = sorted(os.listdir(old["plain"] / KEY))[0]
    before, after = ((v["plain"] / KEY / name).read_bytes() for v in (old, new))
    assert len(before) == len(after) == 2 * PIECE and before[PIECE:] != after[PIECE:]

    async def main() -> tuple[list[dict], Exception | None]:
        session = await OpenedSource.open(str(src))
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) == 2:
                for shard in sorted((new["sharded"] / KEY).glob("*.shard")):  # as a writer would: renamed in
                    shutil.copyfile(shard, src / KEY / (shard.name + ".tmp"))
                    os.rename(src / KEY / (shard.name + ".tmp"), src / KEY / shard.name)

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "method": "GET", "path": f"/{KEY}/{name}", "raw_path": f"/{KEY}/{name}".encode(),
                 "headers": [], "query_string": b""}
        failure: Exception | None = None
        try:
            async with session.running():
                try:
                    await TreeApp(session.tree, session.stats)(scope, receive, send)
                except Exception as e:  # noqa: BLE001 - the app must answer its failures itself
                    failure = e
        finally:
            await session.aclose()
        return sent, failure

    sent, failure = trio.run(main)
    # The old version's first piece, then nothing: no second answer, no new bytes, not complete
    # (the server ends such a response's connection). Before: all of it, the second MiB new.
    assert [(m["type"], m.get("status"), m.get("more_body")) for m in sent] == [
        ("http.response.start", 200, None), ("http.response.body", None, True)]
    assert sent[1]["body"] == before[:PIECE] and failure is None
