"""The benchmark's pieces: one reporter, mounts and workloads, datasets, and one module per scenario.

`scripts/bench` runs the scenarios listed in `scenarios.SCENARIOS` (all, or
those named with `--only`); each records its figures through a `Report`
next to a baseline measured in the same run.
"""
