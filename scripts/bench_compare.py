"""Entry point of scripts/bench-compare (see benchmarks/compare.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks package lives beside this script

from benchmarks.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
