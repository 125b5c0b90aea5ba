"""The format registry: formats are plug-ins that register themselves.

Each format package has a plugin module ending in `register_format(...)`;
the modules are found through the `unshardfs.formats` entry point group
(pyproject.toml), so adding a format edits nothing shared but that one
line, and third-party packages can add formats the same way. A plugin
supplies detection (URL prefixes, root metadata), its own command-line
options, and `open`, which returns a `Dataset`: the virtual tree and a
format-neutral inventory for `inspect`.
"""

from __future__ import annotations

import argparse
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import AsyncIterator, Callable

from ..core.inventory import InventoryPart
from ..core.runtime import Runtime
from ..errors import ConfigError
from ..sources.base import ByteSource
from ..vtree import DirNode

log = logging.getLogger(__name__)

@dataclass
class Dataset:
    tree: DirNode
    # Every sharded part, found from metadata (a Zarr store's arrays are
    # resolved on the way, so this is an async iterator).
    inventory: Callable[[], AsyncIterator[InventoryPart]]


class FormatPlugin(ABC):
    name: str
    description: str  # "Neuroglancer precomputed"
    marker: str  # what detection looks for, for the error when nothing is found: "an info file"
    prefixes: tuple[str, ...] = ()  # URL prefixes naming the format, as Neuroglancer writes them
    priority: int = 0  # detection order, highest first (a DVID export also has an `info`)

    def add_options(self, group: argparse._ArgumentGroup) -> None:
        """Add this format's command-line options."""

    def options(self, args: argparse.Namespace) -> dict:
        """This format's options as given on the command line (only those set; picklable)."""
        return {}

    @abstractmethod
    async def detect(self, source: ByteSource, options: dict) -> bool:
        """Whether `source` holds this format (may raise ConfigError with a hint)."""

    @abstractmethod
    async def open(self, runtime: Runtime, options: dict) -> Dataset:
        """Read and validate the metadata (ConfigError when bad) and build the tree."""


_PLUGINS: dict[str, FormatPlugin] = {}
_loaded = False


def register_format(plugin: FormatPlugin) -> FormatPlugin:
    _PLUGINS[plugin.name] = plugin
    return plugin


def plugins() -> list[FormatPlugin]:
    """Every registered format, in detection order."""
    global _loaded
    if not _loaded:
        _loaded = True
        for ep in entry_points(group="unshardfs.formats"):
            try:
                ep.load()  # the module registers its plugin at its foot
            except Exception as e:  # a broken third-party plugin must not break the others
                log.warning("format plug-in %s could not be loaded: %s", ep.name, e)
    return sorted(_PLUGINS.values(), key=lambda p: -p.priority)


def plugin(name: str) -> FormatPlugin:
    for p in plugins():
        if p.name == name:
            return p
    raise ConfigError(f"unknown format {name!r} (known: {', '.join(p.name for p in plugins())})")


def split_format(url: str) -> tuple[str | None, str]:
    """(format named by a URL prefix or None, the rest of the URL)."""
    for p in plugins():
        for prefix in p.prefixes:
            if url.startswith(prefix):
                return p.name, url[len(prefix):]
    return None, url


def add_format_options(parser: argparse.ArgumentParser) -> None:
    for p in plugins():
        group = parser.add_argument_group(f"{p.description} options")
        p.add_options(group)


def given_options(args: argparse.Namespace) -> dict[str, dict]:
    """Per format, the options given on the command line (only formats with any)."""
    return {p.name: opts for p in plugins() if (opts := p.options(args))}


async def detect(source: ByteSource, named: str | None, given: dict[str, dict]) -> FormatPlugin:
    if named is not None:
        return plugin(named)
    for p in plugins():
        if await p.detect(source, given.get(p.name, {})):
            return p
    markers = " nor ".join(f"{p.marker} ({p.description})" for p in reversed(plugins()))
    hint = " (or the store refuses to let us read them: check the URL and credentials)" if source.remote else ""
    raise ConfigError(f"{source.description} has neither {markers}{hint}")


async def open_dataset(runtime: Runtime, named: str | None, given: dict[str, dict]) -> Dataset:
    """Detect (or take the named) format, refuse options of other formats, open it."""
    chosen = await detect(runtime.source, named, given)
    for name in given:
        if name != chosen.name:
            flags = ", ".join("--" + key.replace("_", "-") for key in given[name])
            verb = "applies" if len(given[name]) == 1 else "apply"
            raise ConfigError(f"{flags} {verb} to {plugin(name).description} stores only; "
                              f"this is {chosen.description}")
    return await chosen.open(runtime, given.get(chosen.name, {}))
