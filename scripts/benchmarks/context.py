"""What every scenario is given: the options, a scratch directory, the datasets (built on first use), the report."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .datasets import build_datasets
from .report import Report

KEY = "1_1_1"  # the scale key of the TensorStore-written volumes


@dataclass
class Context:
    args: argparse.Namespace
    report: Report = field(default_factory=Report)
    work: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="unshardfs-bench-")))
    _datasets: dict[str, Any] | None = None

    @property
    def datasets(self) -> dict[str, Any]:
        if self._datasets is None:
            self._datasets = build_datasets(Path(self.args.data).resolve(), self.args.full)
        return self._datasets

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
