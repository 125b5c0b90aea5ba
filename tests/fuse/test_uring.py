"""FUSE over io_uring (`--fuse-transport uring`): the same file system through ring entries, and
the fallback to /dev/fuse where the kernel does not grant it. Through real mounts (requests
counted by the daemon) and, for the negotiation, in process."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator

import pytest
import trio

from unshardfs.fuse import abi, server
from unshardfs.fuse.server import InitConfig
from unshardfs.fuse.uring import UringUnavailable, possible_cpus
from unshardfs.testing.precomputed import Scale, sharding, write_volume
from unshardfs.testing.setups import ENABLE_URING, module_parameter

from .test_session import exchange, init_ext_body, request

KEY = "1_1_1"
CHUNK = 2 << 20
ENABLE = ENABLE_URING


@pytest.fixture(scope="module")
def volume(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("uring")
    return write_volume(root, [Scale((256, 256, 128), (128, 128, 128), sharding(minishard=1, shard=1))], "uint8")


@pytest.fixture
def uring_enabled(request) -> Iterator[bool]:
    """The fuse module's enable_uring set to `request.param` (Y/N) for the test, then restored;
    the other tests that need it wait meanwhile."""
    if not ENABLE.exists() or os.geteuid() != 0:
        pytest.skip("needs root and a fuse module with enable_uring (Linux >= 6.14)")
    with module_parameter(ENABLE, request.param):
        yield request.param == "Y"


def read_all(m, volume) -> dict[str, int]:
    names = sorted(os.listdir(m.path / KEY))
    assert names == sorted(os.listdir(volume["plain"] / KEY))
    before = m.stats()["fuse"]
    for name in names:
        assert (m.path / KEY / name).read_bytes() == (volume["plain"] / KEY / name).read_bytes()
    after = m.stats()["fuse"]
    return {k: after[k] - before[k] for k in ("reads", "read_bytes", "ring_requests", "requests")}


@pytest.mark.parametrize("uring_enabled", ["Y"], indirect=True)
def test_a_mount_over_io_uring_serves_the_same_bytes_in_full_size_requests(volume, mount, uring_enabled):
    m = mount(volume["sharded"], "--fuse-transport", "uring")
    features = m.stats()["fuse"]["features"]
    if not features["io_uring"]:
        pytest.skip(f"the kernel does not grant FUSE over io_uring (protocol {features['protocol']})")
    assert features["protocol"] == "7.42"
    chunks = len(os.listdir(volume["plain"] / KEY))
    got = read_all(m, volume)
    # Every request came through the ring; replies are copied into its entries, so no pipe
    # bounds them: requests are as large as the kernel allows, a 2 MiB chunk in 2 READs there.
    assert got["ring_requests"] == got["requests"] > 0
    assert features["request_kib"] == features["request_kib_limit"]
    if features.get("read_ahead_kib"):
        assert got["reads"] == chunks * math.ceil(CHUNK / (features["request_kib"] << 10))
    assert got["read_bytes"] == chunks * CHUNK


@pytest.mark.parametrize("uring_enabled", ["N"], indirect=True)
def test_where_the_kernel_does_not_grant_it_requests_go_through_dev_fuse(volume, mount, uring_enabled):
    m = mount(volume["sharded"], "--fuse-transport", "uring")
    features = m.stats()["fuse"]["features"]
    assert features["io_uring"] is False and features["protocol"] == "7.40"
    got = read_all(m, volume)
    assert got["ring_requests"] == 0 and got["reads"] > 0


# -- the negotiation, in process ---------------------------------------------------------------

OFFERED = init_ext_body(45, 0xFFFFFFFF & ~abi.INIT_EXT, abi.OVER_IO_URING >> 32)


def test_not_asked_for_no_ring_is_made(monkeypatch):
    monkeypatch.setattr(server, "Ring", None)  # would fail if called
    (reply,), session = trio.run(exchange, [request(abi.Op.INIT, 1, OFFERED)], 1, None, InitConfig())
    fields = abi.INIT_OUT.unpack(reply[2])
    assert fields[1] == abi.KERNEL_MINOR and not fields[10] << 32 & abi.OVER_IO_URING
    assert session.uring is None


def test_a_ring_that_cannot_be_made_is_not_asked_for(monkeypatch):
    """Once the kernel has granted io_uring it queues requests for the ring only: a ring that
    cannot be made (io_uring disabled by sysctl, a seccomp filter) must mean the flag stays off."""
    def refused(*args, **kwargs):
        raise UringUnavailable("io_uring_setup: Operation not permitted")

    monkeypatch.setattr(server, "Ring", refused)
    (reply,), session = trio.run(exchange, [request(abi.Op.INIT, 1, OFFERED)], 1, None,
                                 InitConfig(transport="uring"))
    fields = abi.INIT_OUT.unpack(reply[2])
    assert fields[1] == abi.KERNEL_MINOR and not fields[10] << 32 & abi.OVER_IO_URING
    assert session.uring is None and session.negotiated.describe()["io_uring"] is False


@pytest.mark.parametrize("text, cpus", [("0-3\n", 4), ("0\n", 1), ("0,2-5\n", 6)])
def test_one_queue_per_possible_cpu(tmp_path, text, cpus):
    path = tmp_path / "possible"
    path.write_text(text)
    assert possible_cpus(str(path)) == cpus
