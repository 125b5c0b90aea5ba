"""webKnossos wrap (WKW) as a format plug-in.

Detected by a `datasource-properties.json` listing WKW layers, or by mag
directories (`1`, `2-2-1`, ...) holding a `header.wkw` (a bare layer).
"""

from __future__ import annotations

from unshardfs.core.registry import Dataset, FormatPlugin, NoOptions
from unshardfs.core.runtime import Runtime
from unshardfs.formats.wkw.properties import PROPERTIES
from unshardfs.sources.base import ByteSource
from unshardfs.util.errors import ConfigError, SourceError
from unshardfs.util.fields import DEFAULT_LIMITS, load_json, off_loop

# Entries of a directory without datasource-properties.json that detection looks at for mag directories.
DETECT_ENTRIES = 1000  # (an object store's page)


class WkwFormat(FormatPlugin[NoOptions]):
    name = "wkw"
    description = "webKnossos WKW"
    marker = "a datasource-properties.json with WKW layers or mag directories with header.wkw"
    # Ahead of Zarr and precomputed: properties listing WKW layers decide, whatever
    # else the directory holds (a webKnossos dataset may keep Zarr layers beside WKW ones).
    priority = 10
    json_names = ("datasource-properties.json",)
    probes = (PROPERTIES, "1/header.wkw")  # the second: where a store that cannot list has a bare mag

    async def detect(self, source: ByteSource, options: NoOptions) -> bool:
        from unshardfs.formats.wkw.dataset import mag_dirs
        from unshardfs.formats.wkw.properties import has_wkw_layers

        st = await source.stat(PROPERTIES)
        if st is not None and not st.is_dir and st.size <= DEFAULT_LIMITS.metadata_bytes:
            try:
                raw = await source.read(PROPERTIES, 0, st.size)
                return has_wkw_layers(await off_loop(len(raw), load_json, raw, PROPERTIES))
            except SourceError:
                return False
            except ConfigError:
                return True  # a broken properties file: `open` says what is wrong with it
        return bool(await mag_dirs(source, DETECT_ENTRIES))

    async def open(self, runtime: Runtime, options: NoOptions) -> Dataset:
        from unshardfs.formats.wkw.dataset import WkwDataset

        dataset = WkwDataset(runtime)
        return Dataset(await dataset.build(), dataset.inventory)

