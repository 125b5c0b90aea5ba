"""Data copied from other projects: their own test files (Icechunk's `test_can_read_old.py`) are
references, not tests to run."""

collect_ignore_glob = ["*"]
