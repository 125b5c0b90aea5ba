"""`unshardfs inspect`: the report of every sharded directory, as text.

The figures come from each format's inventory (`Dataset.inventory`): shard
and chunk indexes only, no payload is read.
"""

from __future__ import annotations

from typing import Any

from unshardfs.sources.base import VersionInfo


def format_report(reports: list[dict[str, Any]], source: str, archive: list[str] | None = None) -> str:
    """`archive`: lines about the zip archive the source is read through, if any. A report with a
    `reason` is a directory not shown as its format would (left out of a view, shown as stored); one
    of kind `dataset` a dataset of a tree of datasets, whose sharded directories follow it."""
    sharded = sum("reason" not in r and r.get("kind") != "dataset" for r in reports)
    datasets = sum(r.get("kind") == "dataset" for r in reports)
    head = f"{sharded} sharded director{'y' if sharded == 1 else 'ies'}"
    if datasets:  # a tree of datasets
        head = f"a tree of {datasets} dataset{'' if datasets == 1 else 's'}, {head}"
    lines = [f"{source}: {head}", *(archive or [])]
    for r in reports:
        lines.append("")
        if r.get("kind") == "dataset":
            lines.append(f"{r['key']}/  (dataset: {r.get('description') or r['format']})")
            lines.extend(r.get("store", ()))
            continue
        if "reason" in r:
            lines.append(f"{r['key']}/  ({r['kind']})")
            lines.append(f"  why           {r['reason']}")
            continue
        lines.append(f"{r['key']}/  ({r['kind']}{', ' + r['encoding'] if r.get('encoding') else ''})")
        lines.append(f"  sharding      {r['layout']}")
        expected = r.get("shards_expected")
        lines.append(f"  shards        {r['shards_present']:,} present" + (f" of {expected:,}" if expected else ""))
        cells = f" of {r['grid_cells']:,} grid cells" if "grid_cells" in r else ""
        lines.append(f"  chunks        {r['chunks']:,}{cells}")
        size = r["stored_chunk_size"]
        lines.append(f"  stored bytes  {r['stored_bytes']:,} (chunk sizes {size['min']:,} .. {size['max']:,}, "
                     f"mean {size['mean']:,.0f})")
        if size["histogram"]:
            hist = ", ".join(f"{k[2:]}+: {v:,}" for k, v in size["histogram"].items())
            lines.append(f"  size buckets  {hist}")
    return "\n".join(lines)


def version_lines(versions: list[VersionInfo], store: str, shown: str, directories: bool) -> list[str]:
    """The versions of the versioned store the source is read through, oldest first: name, commit time,
    entries and bytes as the writer recorded them; which one is shown (`shown`), and whether the others
    are directories of the mount."""
    where = "each a directory @NAME of the mount's root" if directories else f"@{shown} named: only it is shown"
    out = [f"  versions      {len(versions):,} in {store} ({where})"]
    width = max([10, *(len(v.name) for v in versions)])
    for v in versions:
        mark = ("  (shown" + (", newest)" if v.latest else ")")) if v.name == shown else ("  (newest)" if v.latest
                                                                                            else "")
        out.append(f"    @{v.name:<{width}} {v.time_text:<30}  {v.entries:>12,} keys  {v.size:>16,} bytes{mark}")
    return out
