"""The few exception types that cross layer boundaries.

Formats raise `DataError` when backing bytes cannot be trusted; the FUSE
adapter turns it into EIO. `ConfigError` is for bad input found before a mount
goes live, which the CLI prints as a one-line message.
"""

import sys

if sys.version_info < (3, 11):  # pragma: no cover - trio installs the backport there
    from exceptiongroup import BaseExceptionGroup


# How much of a message, and of one quoted value, may reach a terminal or a log: untrusted
# metadata can hold megabytes in one member, and an error repeating it is no longer one line.
MESSAGE_LIMIT = 800
QUOTE_LIMIT = 200

# Control characters (and the Unicode line breaks) shown escaped: a message is one line.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(32), 0x7F)} | {
    ord("\n"): "\\n", ord("\r"): "\\r", ord("\t"): "\\t", 0x85: "\\x85", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` on one line and at most about `limit` characters: control characters escaped, and
    the middle of a longer text replaced by a count (the start names the place, the end often the
    option that helps)."""
    if len(text) > limit:
        head, tail = limit * 3 // 4, limit // 4
        text = f"{text[:head]}...[{len(text) - head - tail:,} characters omitted]...{text[-tail:]}"
    return text.translate(_ESCAPES)


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """A short repr of an untrusted value: strings cut before they are repr'd, containers rendered
    only until `limit` characters (a repr of a huge or deep JSON tree is never built)."""
    pieces: list[str] = []
    size = 0
    # A stack of what remains to render: values, and literal text between them.
    stack: list[tuple[bool, object]] = [(False, value)]
    while stack and size <= limit:
        literal, item = stack.pop()
        if literal:
            text = str(item)
        elif isinstance(item, dict):
            text = "{"
            rest: list[tuple[bool, object]] = [(True, "}")]
            for i, (k, v) in enumerate(item.items()):
                if i * 2 > limit:  # never walk more members than could be shown
                    rest.append((True, ", ..."))
                    break
                rest += [(True, ", " if i else ""), (False, k), (True, ": "), (False, v)]
            stack += [rest[0], *reversed(rest[1:])]
        elif isinstance(item, (list, tuple)):
            text = "["
            rest = [(True, "]")]
            for i, v in enumerate(item[: limit // 2 + 1]):
                rest += [(True, ", " if i else ""), (False, v)]
            if len(item) > limit // 2 + 1:
                rest.append((True, ", ..."))
            stack += [rest[0], *reversed(rest[1:])]
        elif isinstance(item, (str, bytes)):
            text = repr(item[: limit + 1])
        elif isinstance(item, int) and item.bit_length() > 4 * limit:  # repr would be long, or refused
            text = f"<an integer of {item.bit_length():,} bits>"
        else:
            text = repr(item)[: limit + 1]
        pieces.append(text)
        size += len(text)
    text = "".join(pieces)
    return one_line(text[:limit] + "..." if size > limit or stack else text, limit + 3)


class UnshardfsError(Exception):
    """Base class, so callers can catch everything of ours in one place.

    A message is made one short line here (`one_line`), so however much
    untrusted text a call site puts into it, no error repeats megabytes.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*(one_line(a) if isinstance(a, str) else a for a in args))


class Located(Exception):
    """Mixin of the errors that name a place (`where`) and what is wrong there (`reason`)."""

    def __init__(self, where: str, reason: str) -> None:
        self.where = one_line(where, QUOTE_LIMIT)
        self.reason = one_line(reason)
        super().__init__(f"{self.where}: {self.reason}")


class ConfigError(UnshardfsError):
    """Invalid source, metadata or command-line input; reported before mounting."""


class DataError(Located, UnshardfsError):
    """Backing data is damaged or inconsistent: the affected file must fail with EIO.

    `where` names the backing object (shard path, chunk id) so that the log line
    lets an operator find the damage; `reason` says what check failed.
    """


class SourceError(UnshardfsError):
    """The byte source failed to deliver (I/O error, vanished object)."""


class StaleError(DataError):
    """The backing object changed since this file was resolved.

    Raised instead of reading a replaced shard at offsets taken from its old
    index; the FUSE adapter then resolves the name afresh.
    """


def expected_failure(error: BaseException) -> UnshardfsError | None:
    """The DataError/SourceError (or ConfigError: metadata found damaged while serving) an error stands for, also when concurrent tasks wrapped it
    in an ExceptionGroup whose every leaf is one of ours; None for anything else (a bug)."""
    if isinstance(error, (DataError, SourceError, ConfigError)):
        return error
    if isinstance(error, BaseExceptionGroup):
        leaves = [expected_failure(e) for e in error.exceptions]
        if leaves and all(leaf is not None for leaf in leaves):
            return leaves[0]
    return None
