"""The package's layers, as pyproject.toml's import contracts state them, hold."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.skip("import-linter is not installed (the test extra installs it)")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run([lint, "--no-cache"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "broken" in result.stdout and "0 broken" in result.stdout
