"""Serve any virtual tree over HTTP: the unsharded view for viewers and machines without FUSE.

An ASGI application (run by `httpserver` on the daemon's trio loop) that knows
nothing of formats: it resolves a URL path in the tree, serves files with
single ranges, validators and CORS, and lists directories as streamed HTML
or JSON. Hostile requests never leave the tree: every path segment is
percent-decoded on its own and must be a valid name (no `..`, no `/`
smuggled in as `%2F`, no NUL), so `..` and encoded slashes are simply names
that do not exist. No answer costs work in proportion to a number or a
length the client chose: path depth and lengths are bounded by the request
head's limit and each name by NAME_BYTES, a lookup walks at most the tree's
own depth, and numbers in headers are read from at most NUMBER_DIGITS digits.
"""

from __future__ import annotations

import email.utils
import html
import json
import logging
import re
import zlib
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Callable, Iterator
from urllib.parse import parse_qs, quote, unquote_to_bytes

import trio

from unshardfs.core.registry import json_names
from unshardfs.sources.base import name_problem
from unshardfs.tree import edge
from unshardfs.tree.nodes import Batch, Closable, DirNode, FileNode, Node
from unshardfs.util.concurrency import stray_cancellation
from unshardfs.util.errors import DataError
from unshardfs.util.maps import BoundedMap

log = logging.getLogger(__name__)

STATS_PATH = "/_unshardfs/stats"  # reserved: the same JSON as a mount's stats xattr
PIECE = 1 << 20  # bytes per body message: bounded memory per response however large the file
PAGE = 10_000  # entries per HTML listing page (million-entry directories stay usable)
# Listings produced at once, all clients together; others wait their turn (holding nothing a reader
# needs). A listing gives the loop back after every batch of entries, even one it only skips.
LISTINGS = 2
METHODS = "GET, HEAD, OPTIONS"
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$", re.IGNORECASE)  # range units are case-insensitive
NAME_BYTES = 1024  # a longer path segment names nothing in any source (and reaches none)
NUMBER_DIGITS = 18  # past any file size; longer numbers are not converted (CPU, and int's digit limit)
_TOKENS = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+(\s*,\s*[A-Za-z0-9!#$%&'*+.^_`|~-]+)*$")

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]


@dataclass(frozen=True)
class ServeOptions:
    cors_origin: str = "*"  # Access-Control-Allow-Origin; "" turns CORS off
    access_log: bool = False


class HttpError(Exception):
    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.headers = headers or {}


def content_type(name: str) -> str:
    """JSON for the metadata file names the formats declare (`FormatPlugin.json_names`) and *.json."""
    if name.endswith(".json") or name in json_names():
        return "application/json"
    return "application/octet-stream"


def etag(node: FileNode) -> str:
    """A strong tag of the file's content: its size and mtime, and a digest of the version of what its
    bytes are stored in (a rewrite that puts the mtime back, a packed store's data file copied over,
    change that alone)."""
    version = node.content_version()
    digest = f"-{zlib.crc32(repr(version).encode()):08x}" if version else ""
    return f'"{node.size:x}-{node.mtime_ns:x}{digest}"'


def http_date(mtime_ns: int) -> str:
    return email.utils.formatdate(mtime_ns / 1e9, usegmt=True)


def parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single byte range, None to serve the whole file.

    Multiple ranges, other units and malformed values are ignored (RFC 9110
    allows serving the whole representation), so no request can make the
    server assemble many pieces. An unsatisfiable range is a 416. A suffix of
    an empty representation is satisfiable (RFC 9110 section 14.1.1) yet names
    no byte a Content-Range could state: the whole, empty, representation.
    """
    if not value:
        return None
    match = _RANGE.match(value.strip())
    if match is None:
        return None
    first, last = match.groups()
    if not first and not last:
        return None
    if not first:  # a suffix: the last N bytes
        n = _number(last)
        if n == 0:
            raise HttpError(416, "empty suffix range", {"Content-Range": f"bytes */{size}"})
        return (max(0, size - n), size) if size else None
    start = _number(first)
    end = min(_number(last) + 1, size) if last else size
    if start >= size or (last and _number(last) < start):
        raise HttpError(416, "range not satisfiable", {"Content-Range": f"bytes */{size}"})
    return start, end


def _number(digits: str) -> int:
    """A decimal number of the Range grammar; one too long to be any offset is simply larger than all."""
    return int(digits) if len(digits.lstrip("0")) <= NUMBER_DIGITS else 1 << 64


def split_path(raw_path: bytes) -> tuple[list[str], bool]:
    """The path's names, each percent-decoded on its own, and whether it ends with '/'."""
    text = raw_path.split(b"?", 1)[0]
    parts = [p for p in text.split(b"/")]
    trailing = len(parts) > 1 and parts[-1] == b""
    names = []
    for part in parts:
        if not part:
            continue  # '//' and the leading '/'
        if len(part) > 3 * NAME_BYTES:
            raise HttpError(404, "not found")
        try:
            name = unquote_to_bytes(part).decode("utf-8")
        except UnicodeDecodeError:
            raise HttpError(404, "not found") from None
        if len(name) > NAME_BYTES or name_problem(name) is not None:  # `..`, an encoded '/', NUL: never a name
            raise HttpError(404, "not found")
        names.append(name)
    return names, trailing


class TreeApp:
    """The ASGI application serving one tree (`stats` feeds STATS_PATH)."""

    def __init__(self, root: DirNode, stats: Callable[[], dict[str, Any]], options: ServeOptions | None = None) -> None:
        self.root = root
        self.stats = stats
        self.options = options or ServeOptions()
        # Directories resolved recently, by path: a chunk request then costs one
        # lookup in its directory, not one per level (bounded, and short-lived so
        # a source that changes is seen again).
        self._dirs: BoundedMap[tuple[str, ...], DirNode] = BoundedMap(4096, ttl=60)
        self._listings = trio.CapacityLimiter(LISTINGS)
        self.counters = {"requests": 0, "bytes": 0, "errors": 0, "not_found": 0, "not_modified": 0}
        # The server's own counters (connections refused, slow clients dropped...), when it has them.
        self.connection_stats: Callable[[], dict[str, int]] | None = None

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return
        self.counters["requests"] += 1
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope["method"]
        status = [0]
        if self.options.access_log:
            send = _recording(send, status)
        try:
            if method == "OPTIONS":
                return await self._reply(send, 204, b"", self._preflight(headers))
            if method not in ("GET", "HEAD"):
                raise HttpError(405, "read-only", {"Allow": METHODS})
            raw = scope.get("raw_path") or scope["path"].encode()
            if raw.split(b"?", 1)[0] == STATS_PATH.encode():
                extra = {"connections": self.connection_stats()} if self.connection_stats else {}
                body = json.dumps({**self.stats(), "http": self.counters, **extra}).encode()
                return await self._reply(send, 200, body, {"Content-Type": "application/json"}, method == "HEAD")
            names, trailing = split_path(raw)
            node = await self._resolve(names)
            if isinstance(node, DirNode):
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                if not trailing and names:
                    location = "/" + "/".join(quote(n, safe="") for n in names) + "/"
                    raise HttpError(301, "directory", {"Location": location})
                await self._listing(send, node, names, headers, query, method == "HEAD")
            else:
                await self._file(send, node, names, headers, method == "HEAD")
        except HttpError as e:
            self.counters["not_found" if e.status == 404 else "errors"] += e.status >= 400
            await self._reply(send, e.status, (str(e) + "\n").encode(), {"Content-Type": "text/plain", **e.headers},
                              method == "HEAD")
        except BaseException as e:  # noqa: BLE001 - every failure is an answer, never a dead server
            if not isinstance(e, Exception) and not stray_cancellation(e):
                raise  # this request's own cancellation (its client gone, the server stopping)
            self.counters["errors"] += 1
            failure = edge.classify(e)
            edge.report(log, failure, scope.get("path", "")[:300], e, answered=str(failure.status))
            code = failure.status
            text = "internal error" if failure.bug else f"the backing data could not be read: {failure.message}"
            await self._reply(send, code, (text + "\n").encode(), {"Content-Type": "text/plain"}, method == "HEAD")
        finally:
            if self.options.access_log:
                origin = headers.get("origin")
                log.info("%s %s %d%s", method, scope.get("path", "")[:300], status[0],
                         f" (origin {origin[:200]})" if origin else "")

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- resolving ---------------------------------------------------------------

    async def _resolve(self, names: list[str]) -> Node:
        node: Node = self.root
        start = 0
        # The parent directory, if known (a chunk's request); else from the root, which stops at
        # the first name absent: never more work than the tree is deep, however deep the path.
        cached = self._dirs.get(tuple(names[:-1])) if len(names) > 1 else None
        if cached is not None:
            node, start = cached, len(names) - 1
        for i in range(start, len(names)):
            if not isinstance(node, DirNode):
                raise HttpError(404, "not found")
            child = await node.lookup(names[i])
            if child is None:
                raise HttpError(404, "not found")
            node = child
            if isinstance(node, DirNode):
                self._dirs[tuple(names[:i + 1])] = node
        return node

    # -- responses ---------------------------------------------------------------

    def _cors(self) -> dict[str, str]:
        origin = self.options.cors_origin
        if not origin:
            return {}
        return {"Access-Control-Allow-Origin": origin,
                "Access-Control-Expose-Headers": "Content-Range, Content-Length, ETag, Last-Modified, Accept-Ranges",
                **({} if origin == "*" else {"Vary": "Origin"})}

    def _preflight(self, headers: dict[str, str]) -> dict[str, str]:
        if not self.options.cors_origin:
            return {"Allow": METHODS}
        asked = headers.get("access-control-request-headers", "").strip()
        allowed = "Range, If-None-Match, If-Modified-Since, If-Range, Accept"
        echo = asked if len(asked) <= 1024 and _TOKENS.match(asked) else allowed  # only a list of header names
        return {"Allow": METHODS, "Access-Control-Allow-Methods": METHODS,
                "Access-Control-Allow-Headers": echo, "Access-Control-Max-Age": "86400"}

    async def _reply(self, send: Send, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
        await self._start(send, status, {**headers, "Content-Length": str(len(body))})
        await send({"type": "http.response.body", "body": b"" if head else body})

    async def _start(self, send: Send, status: int, headers: dict[str, str]) -> None:
        merged = {**self._cors(), **headers}
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in merged.items()]})

    async def _file(self, send: Send, node: Node, names: list[str], headers: dict[str, str], head: bool,
                    followed: bool = False) -> None:
        assert isinstance(node, FileNode)
        tag = etag(node)
        validators = {"ETag": tag, "Last-Modified": http_date(node.mtime_ns), "Accept-Ranges": "bytes",
                      "Content-Type": content_type(names[-1] if names else "")}
        if _not_modified(headers, tag, node.mtime_ns):
            self.counters["not_modified"] += 1
            return await self._reply(send, 304, b"", {k: v for k, v in validators.items()
                                                     if k in ("ETag", "Last-Modified")})
        # An If-Range that does not hold (another version, or a date: only the strong ETag is
        # compared) means the Range is ignored, however unsatisfiable (RFC 9110 section 13.2.2).
        if_range = headers.get("if-range")
        wanted = parse_range(headers.get("range"), node.size) if if_range is None or if_range.strip() == tag else None
        start, end = wanted if wanted is not None else (0, node.size)
        extra = {"Content-Range": f"bytes {start}-{end - 1}/{node.size}"} if wanted is not None else {}
        # The first piece is read before the status goes out, so a damaged file
        # is a 502, not a 200 cut short.
        fresh, first = await self._read(node, names, start, min(PIECE, end - start), follow=not followed)
        if fresh is not node:
            # The file changed since it was looked up: its validators (and what a condition on them
            # decided) are the new content's, so the request is answered again from it (once).
            return await self._file(send, fresh, names, headers, head, followed=True)
        await self._start(send, 206 if wanted is not None else 200,
                          {**validators, **extra, "Content-Length": str(end - start)})
        if head:
            return await send({"type": "http.response.body", "body": b""})
        offset = start + len(first)
        await send({"type": "http.response.body", "body": first, "more_body": offset < end})
        self.counters["bytes"] += len(first)
        try:
            while offset < end:
                # The rest from the very version the head (its ETag) and first piece came from:
                # a shard replaced now fails the response instead of finishing it with new bytes.
                node, data = await self._read(node, names, offset, min(PIECE, end - offset), follow=False)
                offset += len(data)
                self.counters["bytes"] += len(data)
                await send({"type": "http.response.body", "body": data, "more_body": offset < end})
        except DataError as e:
            # The head is out: no other answer can follow. Left unfinished, the response is cut
            # (the server ends the connection), which a client sees as a failure, not a file.
            self.counters["errors"] += 1
            edge.report(log, edge.classify(e), "/".join(names), e, answered="a response cut short")

    async def _read(self, node: FileNode, names: list[str], offset: int, size: int,
                    follow: bool = True) -> tuple[FileNode, bytes]:
        """Exactly `size` bytes (or DataError); a file whose shard was replaced is re-resolved once
        (with `follow`; else that is a DataError too)."""
        if size <= 0:
            return node, b""

        async def resolve() -> Node | None:
            return await self._resolve(names) if names and follow else None

        node, data = await edge.read_current(node, offset, size, resolve)
        if len(data) != size:
            raise DataError("/".join(names), f"short read at {offset}: {len(data)} of {size} bytes")
        return node, data

    async def _listing(self, send: Send, node: DirNode, names: list[str], headers: dict[str, str],
                       query: dict[str, list[str]], head: bool) -> None:
        as_json = query.get("format", [""])[0] == "json" or "application/json" in headers.get("accept", "")
        page = _int(query.get("page", ["0"])[0])
        kind = "application/json" if as_json else "text/html; charset=utf-8"
        # Streamed (chunked): a directory of a million chunks is never held in memory.
        await self._start(send, 200, {"Content-Type": kind, "Cache-Control": "no-cache"})
        if head:
            return await send({"type": "http.response.body", "body": b""})
        body = _json_listing(node) if as_json else _html_listing(node, names, page)
        # A listing is CPU work whose cost the client picks (a million entries, a page past the end of
        # them): at most LISTINGS pieces are being made at once, and each gives the loop back between
        # batches. A turn is held while a piece is made, never while it is sent: a client that stops
        # reading its listing holds no turn.
        async with aclosing(body):
            while True:
                async with self._listings:
                    piece = await anext(body, None)
                if piece is None:
                    break
                await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


def _int(text: str) -> int:
    return int(text) if text.isdigit() and len(text) < 10 else 0


def _recording(send: Send, status: list[int]) -> Send:
    """`send`, noting the response status in `status[0]` (for the access log)."""
    async def recorded(message: Message) -> None:
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        await send(message)
    return recorded


def _not_modified(headers: dict[str, str], tag: str, mtime_ns: int) -> bool:
    if "if-none-match" in headers:
        value = headers["if-none-match"]
        return (tag in value and tag in [t.strip() for t in value.split(",")]) or value.strip() == "*"
    since = headers.get("if-modified-since")
    if since and len(since) <= 64:  # an HTTP date is 29 characters
        try:
            when = email.utils.parsedate_to_datetime(since).timestamp()
        except (TypeError, ValueError, OverflowError, IndexError):
            return False
        return mtime_ns // 1_000_000_000 <= when
    return False


async def _batches(node: DirNode) -> AsyncGenerator[Batch, None]:
    """`node`'s entries, batch by batch, with a checkpoint after each: a batch made without waiting on
    anything (indexes cached, names computed) would otherwise keep the loop from every other client."""
    listing = node.entries()
    try:
        async for batch in listing:
            yield batch
            await trio.lowlevel.checkpoint()
    finally:
        if isinstance(listing, Closable):
            await listing.aclose()


def _rows(batch: Batch) -> Iterator[tuple[str, bool, int]]:
    """(name, is_dir, size) of each entry of a batch (a lazy batch builds no node)."""
    if isinstance(batch, list):
        for name, child in batch:
            yield name, child.is_dir, child.size if isinstance(child, FileNode) else 0
    else:
        for name, size in zip(batch.names, batch.sizes):
            yield name, False, size


async def _json_listing(node: DirNode) -> AsyncGenerator[bytes, None]:
    pieces: list[str] = []
    first = True
    yield b"["
    async with aclosing(_batches(node)) as batches:
        async for batch in batches:
            for name, is_dir, size in _rows(batch):
                item: dict[str, object] = {"name": name, "type": "directory" if is_dir else "file"}
                if not is_dir:
                    item["size"] = size
                pieces.append(("" if first else ",") + json.dumps(item))
                first = False
                if len(pieces) >= 1024:
                    yield "".join(pieces).encode()
                    pieces = []
    yield ("".join(pieces) + "]").encode()


async def _html_listing(node: DirNode, names: list[str], page: int) -> AsyncGenerator[bytes, None]:
    title = html.escape("/" + "/".join(names) + ("/" if names else ""))
    yield (f"<!doctype html><meta charset=utf-8><title>{title}</title><h1>Index of {title}</h1>"
           f"<ul>{'<li><a href=../>../</a>' if names else ''}").encode()
    lines: list[str] = []
    index = 0
    more = False
    async with aclosing(_batches(node)) as batches:
        async for batch in batches:
            if index + len(batch) <= page * PAGE:  # before the page: counted, not looked at
                index += len(batch)
                continue
            for name, is_dir, size in _rows(batch):
                if index >= (page + 1) * PAGE:
                    more = True
                    break
                if index >= page * PAGE:
                    href = quote(name, safe="") + ("/" if is_dir else "")
                    label = html.escape(name) + ("/" if is_dir else "")
                    lines.append(f"<li><a href=\"{href}\">{label}</a>{'' if is_dir else f' {size:,}'}")
                    if len(lines) >= 1024:
                        yield "".join(lines).encode()
                        lines = []
                index += 1
            if more:
                break
    nav = ""
    if page:
        nav += f"<a href=\"?page={page - 1}\">previous {PAGE:,}</a> "
    if more:
        nav += f"<a href=\"?page={page + 1}\">next {PAGE:,}</a>"
    yield ("".join(lines) + f"</ul>{nav}").encode()

