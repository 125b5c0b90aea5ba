"""The format registry: formats are plug-ins named by entry points.

Each entry point of the `unshardfs.formats` group names a `FormatPlugin`
class or instance (`yourpkg.plugin:YourFormat`); those of
`unshardfs.codecs` name `Codec` classes (`yourpkg.codecs:YourCodec`). Both
are loaded here, once, so adding a format edits nothing shared but its entry
point line, and third-party packages add formats and codecs the same way.
A plugin supplies detection (URL prefixes, root metadata), its own
command-line options, the index levels it caches, the names of its JSON
files, and `open`, which returns a `Dataset`: the virtual tree and a
format-neutral inventory for `inspect`.
"""

from __future__ import annotations

import argparse
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from importlib.metadata import EntryPoint, entry_points
from typing import Any, AsyncIterator, Awaitable, Callable, Generic, Iterable, Mapping, TypeVar, cast

from unshardfs.core.caches import SHARD_INDEX, IndexLevel
from unshardfs.core.codecs import CODECS, Codec, register_codec
from unshardfs.core.inventory import InventoryPart
from unshardfs.core.runtime import Runtime
from unshardfs.sources.base import ByteSource, stat_all
from unshardfs.tree.nodes import DirNode
from unshardfs.util.errors import ConfigError

log = logging.getLogger(__name__)

@dataclass
class Dataset:
    tree: DirNode
    # Every sharded part, found from metadata (a Zarr store's arrays are
    # resolved on the way, so this is an async iterator).
    inventory: Callable[[], AsyncIterator[InventoryPart]]
    format: str | None = None  # the plug-in that opened it (set by `open_dataset`)
    # A dataset of a tree of datasets read from a versioned store (an OCDBT database, an Icechunk
    # repository): what `inspect` says of that store (its versions, what it deleted), as report lines.
    about: Callable[[], Awaitable[list[str]]] | None = None


@dataclass(frozen=True)
class NoOptions:
    """The options of a format that takes none."""


OptionsT = TypeVar("OptionsT")


def changed_options(options: object) -> dict[str, Any]:
    """The fields of a format's options that differ from their defaults, by name (what was given)."""
    default = type(options)()
    return {f.name: getattr(options, f.name) for f in fields(cast(Any, options))
            if getattr(options, f.name) != getattr(default, f.name)}


class FormatPlugin(ABC, Generic[OptionsT]):
    """One storage format: how to recognise it and how to show it.

    Contract: `detect` and `open` only read the source (never write);
    `detect` answers False for another format's data and raises ConfigError
    only with a hint for the user; `open` raises ConfigError for bad
    metadata (MetadataError, a ConfigError, names the member) and never
    fails later for it; damage found while serving is the tree's DataError.
    Its options are one frozen dataclass (`options_type`, every field with a default,
    picklable: split check/export ship them to workers), its fields named as the
    command-line flags that set them.
    """

    name: str
    description: str  # "Neuroglancer precomputed"
    marker: str  # what detection looks for, for the error when nothing is found: "an info file"
    prefixes: tuple[str, ...] = ()  # URL prefixes naming the format, as Neuroglancer writes them
    priority: int = 0  # detection order, highest first (a DVID export also has an `info`)
    # The index levels its stores cache (each gets one cache and one budget option).
    index_levels: tuple[IndexLevel, ...] = (SHARD_INDEX,)
    # File names of JSON metadata it shows (besides *.json), served as application/json.
    json_names: tuple[str, ...] = ()
    # Paths at the source's root that `detect` (and `open` first) stats. A remote source's detection
    # stats every format's probes at once beforehand, so detection waits one round trip however many
    # formats look, and the stats are kept for `detect` and `open`. Optional: it only saves time.
    probes: tuple[str, ...] = ()

    def add_options(self, group: argparse._ArgumentGroup) -> None:
        """Add this format's command-line options."""

    # This format's options: a frozen dataclass whose defaults mean "none given".
    options_type: type[Any] = NoOptions

    def default_options(self) -> OptionsT:
        """The options when the command line gives none."""
        return cast(OptionsT, self.options_type())

    def options(self, args: argparse.Namespace) -> OptionsT:
        """This format's options from the command line (its defaults where none is given)."""
        return self.default_options()

    @abstractmethod
    async def detect(self, source: ByteSource, options: OptionsT) -> bool:
        """Whether `source` holds this format (may raise ConfigError with a hint)."""

    @abstractmethod
    async def open(self, runtime: Runtime, options: OptionsT) -> Dataset:
        """Read and validate the metadata (ConfigError when bad) and build the tree."""


_PLUGINS: dict[str, FormatPlugin[Any]] = {}
_loaded = False
_json_names: frozenset[str] | None = None  # of the registered formats (serve asks on every request)
FORMAT_GROUP = "unshardfs.formats"
CODEC_GROUP = "unshardfs.codecs"


def register_format(plugin: FormatPlugin[Any] | type[FormatPlugin[Any]]) -> FormatPlugin[Any]:
    """Register a format (a class is instantiated); the entry points do this for installed packages."""
    instance = plugin() if isinstance(plugin, type) else plugin
    if not isinstance(instance, FormatPlugin):
        raise TypeError(f"{plugin!r} is not a FormatPlugin")
    global _json_names
    _PLUGINS[instance.name] = instance
    _json_names = None
    return instance


def unregister_format(name: str) -> None:
    """Forget the format registered as `name` (a plug-in's tests register one for a while)."""
    global _json_names
    _PLUGINS.pop(name, None)
    _json_names = None


def _load(group: str, what: str) -> Iterable[tuple[EntryPoint, object]]:
    for ep in entry_points(group=group):
        try:
            yield ep, ep.load()
        except Exception as e:  # a broken third-party plugin must not break the others
            log.warning("%s plug-in %s could not be loaded: %s", what, ep.name, e)


def load_plugins() -> None:
    """Load every format and codec named by an entry point (once)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for ep, obj in _load(CODEC_GROUP, "codec"):
        if isinstance(obj, type) and issubclass(obj, Codec):
            register_codec(obj)
        else:
            log.warning("codec plug-in %s names %r, not a Codec class", ep.name, obj)
    for ep, obj in _load(FORMAT_GROUP, "format"):
        if isinstance(obj, FormatPlugin) or (isinstance(obj, type) and issubclass(obj, FormatPlugin)):
            register_format(obj)
        else:
            log.warning("format plug-in %s names %r, not a FormatPlugin", ep.name, obj)


def plugins() -> list[FormatPlugin[Any]]:
    """Every registered format, in detection order."""
    load_plugins()
    return sorted(_PLUGINS.values(), key=lambda p: -p.priority)


def codecs() -> dict[str, type[Codec]]:
    """Every registered codec by name (the core's and the plug-ins')."""
    load_plugins()
    return dict(CODECS)


def index_levels() -> list[IndexLevel]:
    """The index levels every format declares, each once (the first declaration of a name wins)."""
    out: dict[str, IndexLevel] = {}
    for p in plugins():
        for level in p.index_levels:
            known = out.setdefault(level.name, level)
            if known != level:
                log.warning("format %s declares index level %s differently (%s); using %s", p.name, level.name,
                            level.option, known.option)
    return list(out.values())


def json_names() -> frozenset[str]:
    """File names every format declares as JSON metadata."""
    global _json_names
    if _json_names is None:
        _json_names = frozenset(name for p in plugins() for name in p.json_names)
    return _json_names


class NotDetected(ConfigError):
    """No format recognises a source (the one-line error says what each looks for): a directory of a
    tree of datasets that is none."""


def plugin(name: str) -> FormatPlugin[Any]:
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


def given_options(args: argparse.Namespace) -> dict[str, object]:
    """Per format, its options as given on the command line (only formats given any)."""
    return {p.name: opts for p in plugins() if (opts := p.options(args)) != p.default_options()}


def detection_probes(named: str | None = None) -> list[str]:
    """The probes of the format `named`, or of every registered format (None), in detection order."""
    chosen = [plugin(named)] if named is not None else plugins()
    return [path for p in chosen for path in p.probes]


async def detect(source: ByteSource, named: str | None, given: Mapping[str, object]) -> FormatPlugin[Any]:
    if named is not None:
        return plugin(named)
    if source.remote:
        await stat_all(source, detection_probes())
    for p in plugins():
        if await p.detect(source, given.get(p.name, p.default_options())):
            return p
    markers = " nor ".join(f"{p.marker} ({p.description})" for p in reversed(plugins()))
    hint = " (or the store refuses to let us read them: check the URL and credentials)" if source.remote else ""
    raise NotDetected(f"{source.description} has neither {markers}{hint}")


async def open_dataset(runtime: Runtime, named: str | None, given: Mapping[str, object],
                       strict: bool = True) -> Dataset:
    """Detect (or take the named) format, refuse options of other formats, open it. Not `strict`: a
    dataset of a tree of datasets, detected as without options (`--info` names one DVID export, not
    every directory) and the options of other formats, meant for its other datasets, left alone."""
    chosen = await detect(runtime.source, named, given if strict else {})
    for name, options in given.items():
        if name != chosen.name and strict:
            changed = changed_options(options)
            flags = ", ".join("--" + key.replace("_", "-") for key in changed)
            verb = "applies" if len(changed) == 1 else "apply"
            raise ConfigError(f"{flags} {verb} to {plugin(name).description} stores only; "
                              f"this is {chosen.description}")
    dataset = await chosen.open(runtime, given.get(chosen.name, chosen.default_options()))
    dataset.format = chosen.name
    return dataset
