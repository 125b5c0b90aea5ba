"""Where precomputed chunks land, computed with CloudVolume's code (not ours)."""

from __future__ import annotations

from collections import defaultdict


def chunk_locations(spec: dict, size: tuple[int, int, int], chunk: tuple[int, int, int]
                    ) -> dict[tuple[int, int], list[str]]:
    """(shard, minishard) -> names of the chunks of a volume of `size` stored there."""
    from cloudvolume.datasource.precomputed.common import compressed_morton_code
    from cloudvolume.datasource.precomputed.sharding import ShardingSpecification

    cv_spec = ShardingSpecification.from_dict(dict(spec))
    grid = [s // c for s, c in zip(size, chunk)]
    groups = defaultdict(list)
    for x in range(grid[0]):
        for y in range(grid[1]):
            for z in range(grid[2]):
                loc = cv_spec.compute_shard_location(int(compressed_morton_code((x, y, z), grid)))
                name = "_".join(f"{g * c}-{(g + 1) * c}" for g, c in zip((x, y, z), chunk))
                groups[(loc.shard_number, int(loc.minishard_number))].append(name)
    return groups
