"""Shared fixtures (real FUSE mounts that are always unmounted, even when a test fails) and the
markers that sort tests into tiers."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import tests.support.profiles  # noqa: F401  (the hypothesis profile, loaded before any test module)
from unshardfs.testing.format_conformance import FormatConformance
from unshardfs.testing.mounts import MountFn, mounting
from unshardfs.testing.setups import DEFAULT

# What a test module uses to reach the kernel or another process: its tests are `mount` tests.
OUT_OF_PROCESS = frozenset({"run_cli", "mounting", "start_daemon", "force_unmount", "daemon_pids", "MountFn"})
# The shipped suites' checks the quick tier keeps as its real mounts, on the default engine and
# transport (marked here, not in the suite, so a third party running the suite needs no markers of ours).
SMOKE = {(FormatConformance, "test_mount_equals_unsharded_twin")}


@pytest.fixture(autouse=True, scope="session")
def _cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Daemons started without --log-file log under $XDG_CACHE_HOME/unshardfs: a directory of the
    session, removed with it, never the user's own cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache-home")))
    yield
    patch.undo()


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[MountFn]:
    """`mount(source, *options)` mounts in the background and returns a `Mount`."""
    yield from mounting(tmp_path)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`mount` on every test that mounts or runs the CLI: it uses the `mount` fixture, or its module
    uses the helpers that start daemons, unless the test's class says it runs in process."""
    for item in items:
        cls = getattr(item, "cls", None)
        setup = getattr(getattr(item, "callspec", None), "params", {}).get("mount", DEFAULT)
        if cls is not None and setup == DEFAULT and any(
                issubclass(cls, base) and item.originalname == name  # type: ignore[attr-defined]
                for base, name in SMOKE):
            item.add_marker(pytest.mark.smoke)
        if item.get_closest_marker("mount"):
            continue
        in_process = getattr(cls, "in_process", False)
        module_names = set(vars(item.module)) if isinstance(item, pytest.Function) and item.module else set()
        if "mount" in getattr(item, "fixturenames", ()) or (not in_process and module_names & OUT_OF_PROCESS):
            item.add_marker(pytest.mark.mount)
