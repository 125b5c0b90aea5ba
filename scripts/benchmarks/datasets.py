"""The benchmark's datasets, built once under --data and reused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import synthetic


def build_datasets(data: Path, full: bool) -> dict[str, Any]:
    from unshardfs.testing.precomputed import Scale, sharding, write_volume

    data.mkdir(parents=True, exist_ok=True)
    marker = data / ("ready-full" if full else "ready")
    out = {
        "small": {"sharded": data / "small" / "sharded", "plain": data / "small" / "plain"},
        "large": {"sharded": data / "large" / "sharded", "plain": data / "large" / "plain"},
        "million": data / "million",
        "shards4096": data / "shards4096",
    }
    if full:
        out["tenmillion"] = data / "tenmillion"
    if marker.exists():
        return out
    print("building benchmark datasets (once) ...", flush=True)
    # 4096 chunks of 16 KiB: small-file work.
    write_volume(data / "small", [Scale((512, 512, 256), (32, 32, 16),
                                        sharding(minishard=6, shard=3, index_enc="gzip"))], "uint8")
    # 64 chunks of 2 MiB raw: big sequential reads.
    write_volume(data / "large", [Scale((512, 512, 256), (128, 128, 128),
                                        sharding(minishard=1, shard=2))], "uint8")
    names = synthetic.write_scale(data / "million", (100, 100, 100), minishard_bits=6, shard_bits=8)
    (data / "million.names").write_text("\n".join(names) + "\n")
    synthetic.write_scale(data / "shards4096", (64, 64, 16), minishard_bits=2, shard_bits=12)
    if full:
        synthetic.write_scale(data / "tenmillion", (250, 200, 200), minishard_bits=8, shard_bits=10)
    marker.write_text("ok")
    return out
