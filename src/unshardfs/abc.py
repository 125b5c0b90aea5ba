"""Everything a format (or byte source, or codec) author builds on, in one place.

Import from here rather than from the modules behind it: this is the
public extension API, and each name's docstring states its contract and
error behaviour. The pieces, bottom up:

- `ByteSource` (`ObjectStat`): bytes by path; `unshardfs.testing.memory.MemorySource`
  is one in memory, `unshardfs.testing.source_conformance.SourceConformance`
  the suite a new source passes.
- `Blob`, `Extent`, `Fetcher`: one stored object as of one `stat`, a byte
  range of it, and the mount's one read path.
- `ChunkTable`: a shard's index entries, id -> validated byte range
  (`ChunkTable.build`), bad entries kept in `bad` (EIO, never absent).
- `ShardedStore[ShardT, IndexT]`: a format's shards and index decoding; the
  core's `locate`/`tables` enforce the damage and placement rules.
  `IndexLevel`/`SHARD_INDEX` declare its cached index levels.
- `Naming` (`DecimalNaming`), `Codec` (`register_codec`, `codec`, `GeometrySized`),
  `Geometry` (`FixedSize`): file names, payload decoding, exact sizes.
- `ChunkContext` + `ShardedDir`: a directory of chunk files from the above.
- `FormatPlugin` + `Dataset` (`InventoryPart`, `ChunkInventory`): the
  plug-in, named by an `unshardfs.formats` entry point
  (`yourpkg.plugin:YourFormat`), generic in its options (a frozen
  dataclass; `NoOptions` for none); `unshardfs.testing.format_conformance.FormatConformance`
  is the suite it passes through a real mount.
- `StoredBytes` (`StoredRange`) on a file, `StoredAt` (`UrlLocation`) on a source: the
  file's bytes are one range of one stored object, at a URL a reader elsewhere can fetch
  (what `unshardfs refs` writes as a kerchunk reference).
- `Fields`, `DataLimits`: metadata parsing with typed errors, bounds on
  untrusted sizes. Errors: `DataError` (damage: EIO), `ConfigError`
  (bad input before serving), `MetadataError` (a ConfigError naming the member).
"""

from __future__ import annotations

from unshardfs.core.blob import Blob
from unshardfs.core.caches import SHARD_INDEX, IndexLevel
from unshardfs.core.chunks import ChunkContext, ChunkFile
from unshardfs.core.codecs import Codec, GeometrySized, codec, register_codec
from unshardfs.core.dirs import ShardedDir
from unshardfs.core.fetch import Extent, Fetcher
from unshardfs.core.geometry import FixedSize, Geometry
from unshardfs.core.inventory import ChunkInventory, InventoryPart
from unshardfs.core.naming import DecimalNaming, Naming, parse_decimal
from unshardfs.core.registry import Dataset, FormatPlugin, NoOptions, register_format, unregister_format
from unshardfs.core.runtime import Runtime
from unshardfs.core.store import ShardedStore
from unshardfs.core.table import ChunkTable
from unshardfs.sources.base import ByteSource, ObjectStat, StoredAt, UrlLocation, join_path
from unshardfs.tree.nodes import BytesFile, DirNode, FileNode, StoredBytes, StoredRange
from unshardfs.util.errors import ConfigError, DataError
from unshardfs.util.fields import Fields, MetadataError
from unshardfs.util.limits import DataLimits

__all__ = [
    "SHARD_INDEX", "Blob", "ByteSource", "BytesFile", "ChunkContext", "ChunkFile", "ChunkInventory", "ChunkTable",
    "Codec", "ConfigError", "DataError", "Dataset", "DecimalNaming", "DirNode", "Extent", "Fetcher", "Fields",
    "FileNode", "FixedSize", "FormatPlugin", "Geometry", "GeometrySized", "IndexLevel", "InventoryPart", "DataLimits", "MetadataError",
    "Naming", "NoOptions", "ObjectStat", "Runtime", "ShardedDir", "ShardedStore", "codec", "join_path", "parse_decimal",
    "StoredAt", "StoredBytes", "StoredRange", "UrlLocation", "register_codec", "register_format", "unregister_format",
]
