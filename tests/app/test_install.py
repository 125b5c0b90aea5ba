"""Installing without a compiler: pyfuse3 is an optional extra, nothing imports it unless its engine
is chosen, a missing pyfuse3 is a one-line error before the mount detaches, and the wheel is pure
Python and mounts from a fresh venv built with no C compiler on PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import unshardfs
from unshardfs.fuse.engines import PYFUSE3_MISSING
from unshardfs.testing import samples
from unshardfs.testing.mounts import force_unmount, run_cli

REPO = Path(__file__).resolve().parents[2]
# Loaded at interpreter start-up (as `sitecustomize`), so it also holds in the daemons a mount
# starts: pyfuse3 looks exactly as it does when it is not installed.
BLOCKER = textwrap.dedent("""\
    import importlib.abc, sys

    class NoPyfuse3(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "pyfuse3" or name.startswith("pyfuse3."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoPyfuse3())
""")


@pytest.fixture
def without_pyfuse3(tmp_path: Path) -> dict[str, str]:
    """An environment in which every Python process started finds no pyfuse3."""
    site = tmp_path / "no-pyfuse3"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("install")
    samples.write_precomputed(root)
    return root


def test_no_module_but_the_pyfuse3_engine_imports_pyfuse3(without_pyfuse3: dict[str, str]) -> None:
    script = textwrap.dedent("""\
        import importlib, json, pkgutil, sys
        import unshardfs
        failed = {}
        for module in pkgutil.walk_packages(unshardfs.__path__, "unshardfs."):
            if module.name == "unshardfs.__main__":  # runs the command line
                continue
            try:
                importlib.import_module(module.name)
            except ImportError as e:
                failed[module.name] = e.name
        print(json.dumps(failed))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env=without_pyfuse3)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"unshardfs.fuse.pyfuse3_engine": "pyfuse3"}


@pytest.mark.parametrize("foreground", [False, True])
def test_the_pyfuse3_engine_without_pyfuse3_says_how_to_get_it(sample: Path, tmp_path: Path,
                                                             without_pyfuse3: dict[str, str],
                                                             foreground: bool) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "daemon.log"
    try:
        result = run_cli("mount", str(sample / "sharded"), str(mnt), "--fuse-engine", "pyfuse3",
                         "--log-file", str(log), *(["-f"] if foreground else []), env=without_pyfuse3)
        assert result.returncode == 1
        assert result.stderr == f"unshardfs: {PYFUSE3_MISSING}\n"
        assert "pip install 'unshardfs[pyfuse3]'" in result.stderr
        assert not os.path.ismount(mnt)
        assert not log.exists()  # said before detaching: no daemon was started
    finally:
        force_unmount(mnt)


def test_the_kernel_engine_mounts_without_pyfuse3(sample: Path, tmp_path: Path,
                                                  without_pyfuse3: dict[str, str]) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        result = run_cli("mount", str(sample / "sharded"), str(mnt), "--log-file", str(tmp_path / "log"),
                         env=without_pyfuse3)
        assert result.returncode == 0, result.stderr
        assert (mnt / "info").read_bytes() == (sample / "plain" / "info").read_bytes()
        assert run_cli("unmount", str(mnt), env=without_pyfuse3).returncode == 0
    finally:
        force_unmount(mnt)


def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"unshardfs {unshardfs.__version__}\n"


def _no_compiler_path(tmp_path: Path) -> str:
    """A PATH holding only the tools a mount needs: no cc, gcc, clang or make for pip to find."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("fusermount3", "umount", "mount"):
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    return str(tools)


@pytest.mark.slow
@pytest.mark.timeout(900)  # fetches the dependencies from the package index
def test_the_wheel_is_pure_python_and_mounts_from_a_fresh_venv_without_a_compiler(sample: Path,
                                                                                    tmp_path: Path) -> None:
    # Built from a copy: an in-tree build would leave build/ and *.egg-info in the checkout.
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(project)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    [wheel] = dist.glob("*.whl")
    assert wheel.name == f"unshardfs-{unshardfs.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert not [n for n in names if n.endswith((".so", ".pyd", ".c"))]
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "pyfuse3" in r and "extra ==" not in r] == []
    assert any("pyfuse3" in r and 'extra == "pyfuse3"' in r for r in requires)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=os.pathsep.join([str(venv / "bin"), _no_compiler_path(tmp_path)]), CC="/bin/false",
               CXX="/bin/false", PIP_DISABLE_PIP_VERSION_CHECK="1")
    report = tmp_path / "report.json"
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--report", str(report),
                                str(wheel)], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr
    # Every distribution came as a wheel: nothing was (or would have to be) compiled.
    fetched = {item["metadata"]["name"]: item["download_info"]["url"] for item in json.loads(report.read_text())["install"]}
    assert [name for name, url in fetched.items() if not url.endswith(".whl")] == []
    assert "pyfuse3" not in {name.lower() for name in fetched}

    cli = str(venv / "bin" / "unshardfs")
    version = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert version.stdout == f"unshardfs {unshardfs.__version__}\n"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        mounted = subprocess.run([cli, "mount", str(sample / "sharded"), str(mnt), "--log-file", str(tmp_path / "log")],
                                 capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
        assert mounted.returncode == 0, mounted.stderr
        plain = sample / "plain"
        shown = sorted(str(p.relative_to(mnt)) for p in mnt.rglob("*") if p.is_file())
        assert shown == sorted(str(p.relative_to(plain)) for p in plain.rglob("*") if p.is_file())
        assert all((mnt / name).read_bytes() == (plain / name).read_bytes() for name in shown)
        missing = subprocess.run([cli, "mount", "--fuse-engine", "pyfuse3", str(sample / "sharded"), str(tmp_path)],
                                 capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        assert (missing.returncode, missing.stderr) == (1, f"unshardfs: {PYFUSE3_MISSING}\n")
        unmounted = subprocess.run([cli, "unmount", str(mnt)], capture_output=True, text=True, timeout=60, env=env)
        assert unmounted.returncode == 0, unmounted.stderr
        assert not os.path.ismount(mnt)
    finally:
        force_unmount(mnt)
