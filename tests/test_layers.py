"""The package's layers, as pyproject.toml's import contracts state them, hold."""

from __future__ import annotations

import os
import re
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


def test_no_class_name_is_defined_twice():
    """One public name per meaning: a class name stands for one class in the whole package (the
    glossary says which, where a word has several senses)."""
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "src" / "unshardfs").rglob("*.py")):
        for line in path.read_text(encoding="utf-8").splitlines():
            m = re.match(r"class ([A-Z][A-Za-z0-9_]*)", line)
            if m:
                seen.setdefault(m.group(1), []).append(path.relative_to(REPO).as_posix())
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
