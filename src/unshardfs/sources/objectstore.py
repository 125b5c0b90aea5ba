"""Google Cloud Storage and S3 (and S3-compatible stores) as listable HTTP sources.

Objects are read with the same ranged GETs as any HTTP source; what the
stores add is listing (GCS JSON API `objects.list`, S3 `ListObjectsV2`, both
with a `/` delimiter so "directories" are common prefixes) and credentials
from their usual environments when present (`sources.cloud`: Google
application default credentials, botocore's chain with SigV4 signing;
otherwise anonymous requests, for public buckets).

Bucket names are checked against the stores' naming rules before anything
connects, and names in listings are untrusted: a name that is not exactly one
usable path segment below the listed prefix ('', '.', '..', '/', NUL,
non-UTF-8, or outside the prefix) is skipped and logged once, never turned
into a path. Listings end with an error when a page is too large, a page token
repeats or there are too many pages, instead of running forever.
"""

from __future__ import annotations

import datetime
import logging
import xml.etree.ElementTree as ET
from contextlib import aclosing
from typing import AsyncGenerator, AsyncIterator, Callable
from urllib.parse import unquote_plus, urlencode

import trio

from unshardfs.sources import h1
from unshardfs.sources.base import UrlLocation, ObjectStat, Version, join_path, name_problem
from unshardfs.sources.cloud import (GCS_ENDPOINT, LISTING_PAGE_LIMIT, S3_NS, aws_region, aws_signature, check_bucket,
                                     google_credentials, google_token, s3_bucket_url)
from unshardfs.sources.http import (ERROR_BODY_LIMIT, MAX_OBJECT_SIZE, HttpOptions, HttpSource, generation_tag,
                                    path_problem, quote_path)
from unshardfs.util.errors import ConfigError, SourceError
from unshardfs.util.fields import Fields, as_str, load_json
from unshardfs.util.logonce import log_once
from unshardfs.util.paging import PageTokens

log = logging.getLogger(__name__)

DIRECTORY = ObjectStat(0, 0, True)

def _iso_ns(value: object) -> int:
    if not isinstance(value, str) or not value:
        return 0
    try:
        return int(datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
    except (ValueError, OverflowError):
        return 0


def _size(value: object) -> int:
    """An object size from a listing (GCS sends a decimal string, S3 an element's text)."""
    if not isinstance(value, str) or not value.isdigit() or int(value) > MAX_OBJECT_SIZE:
        raise ValueError(f"object size {value!r}")
    return int(value)


class _PrefixListing(HttpSource):
    """Shared logic: a store under `<bucket>/<prefix>` listed page by page."""

    scheme = ""  # of the store's URLs: "gs" or "s3"
    listable = True
    # A store's API never needs one to answer a read; following one would leave the bucket.
    follow_redirects = False
    # A listing of more pages (1000 names each) ends in an error rather than running on.
    max_pages = 10_000

    def __init__(self, bucket: str, base_url: str, prefix: str, options: HttpOptions | None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        super().__init__(base_url, options, f"{self.scheme}://{bucket}/{self.prefix}".rstrip("/"))
        problem = path_problem(self.prefix) if self.prefix else None
        if problem is not None:
            raise ConfigError(f"{self.description}: prefix {problem}")

    def where(self, listed: str) -> str:
        return f"listing {self.scheme}://{self.bucket}/{listed}"

    def full_path(self, path: str) -> str:
        return "/".join(p for p in (self.prefix, path) if p)

    def object_url(self, path: str) -> str:
        return f"{self.base_url}/{quote_path(self.full_path(path))}"

    async def stored_at(self, path: str, version: Version | None) -> UrlLocation | None:
        """`gs://BUCKET/KEY` or `s3://BUCKET/KEY`, as the store's own clients name the object (`StoredAt`)."""
        root = f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")
        return UrlLocation(root, path, f"{self.scheme}://{self.bucket}/{self.full_path(path)}", 0, version or ())

    async def page(self, prefix: str, limit: int | None, token: str | None
                   ) -> tuple[list[tuple[str, ObjectStat]], list[str], str | None]:
        """One page of the listing: (objects, sub-prefixes, token of the next page or None)."""
        raise NotImplementedError

    async def listing(self, url: str, prefix: str) -> bytes:
        """The body of one listing page, at most LISTING_PAGE_LIMIT bytes."""
        reply = await self.request("GET", url, limit=lambda status: LISTING_PAGE_LIMIT if status == 200
                                   else ERROR_BODY_LIMIT)
        if reply.status != 200:
            raise SourceError(f"{self.where(prefix)}: HTTP {reply.status}")
        if reply.body is None:
            raise SourceError(f"{self.where(prefix)}: a page of more than {LISTING_PAGE_LIMIT >> 20} MiB")
        return reply.body

    async def pages(self, prefix: str, limit: int | None
                    ) -> AsyncGenerator[tuple[list[tuple[str, ObjectStat]], list[str]], None]:
        """(objects, sub-prefixes) directly under `prefix` (ending in '/'), page by page; with
        `limit`, only the first page."""
        tokens = PageTokens(self.max_pages, lambda why: SourceError(f"{self.where(prefix)}: {why}"))
        for token in tokens:
            objects, prefixes, following = await self.page(prefix, limit, token)
            yield objects, prefixes
            if not limit:
                tokens.follow(following)

    def _child(self, listed: str, name: str, directory: bool) -> str | None:
        """The name that `name` (a key or, with `directory`, a common prefix from the listing of
        `listed`) has in that directory; None, logged once, when it is no usable file name."""
        if name == listed and not directory:
            return None  # the empty "folder" object some tools write for a prefix
        child = name[len(listed):] if name.startswith(listed) else None
        if child is not None and directory and child.endswith("/"):
            child = child[:-1]
        problem = f"{name!r} (not under the listed prefix)" if child is None else name_problem(child)
        if problem is None:
            return child
        where = self.where(listed)
        log_once(log, f"{where}:{problem}", "%s: skipping %s", where, problem)
        return None

    async def list(self, path: str) -> AsyncIterator[tuple[str, ObjectStat]]:
        if path and path_problem(path):
            return
        full = self.full_path(path)
        listed = f"{full}/" if full else ""
        async with aclosing(self.pages(listed, None)) as pages:
            async for objects, prefixes in pages:
                for name in prefixes:
                    child = self._child(listed, name, directory=True)
                    if child is not None:
                        yield child, DIRECTORY
                for name, st in objects:
                    child = self._child(listed, name, directory=False)
                    if child is not None:
                        self._stats[join_path(path, child)] = st
                        yield child, st

    async def stat_dir(self, path: str) -> ObjectStat | None:
        if not path:
            return DIRECTORY
        if path_problem(path):
            return None
        # Anything under the prefix makes it a directory; `list` vets the names of its children.
        async with aclosing(self.pages(f"{self.full_path(path)}/", 1)) as pages:
            async for objects, prefixes in pages:
                return DIRECTORY if objects or prefixes else None
        return None


class GcsSource(_PrefixListing):
    scheme = "gs"

    def __init__(self, bucket: str, prefix: str, options: HttpOptions | None = None,
                 endpoint: str | None = None) -> None:
        check_bucket(bucket, self.scheme)
        # Credentials go to the endpoint only (see `HttpSource._send`): Google's, unless one is given.
        self.endpoint = (endpoint or GCS_ENDPOINT).rstrip("/")
        super().__init__(bucket, f"{self.endpoint}/{bucket}", prefix, options)
        self._credentials = google_credentials()

    async def authorize(self, request: h1.ClientRequest) -> None:
        creds = self._credentials
        if creds is None:
            return
        token = creds.token if creds.valid else await trio.to_thread.run_sync(google_token, creds)
        request.headers["Authorization"] = f"Bearer {token}"

    async def page(self, prefix: str, limit: int | None, token: str | None
                   ) -> tuple[list[tuple[str, ObjectStat]], list[str], str | None]:
        query = {"prefix": prefix, "delimiter": "/",
                 "fields": "items(name,size,updated,etag,generation),prefixes,nextPageToken"}
        if limit:
            query["maxResults"] = str(limit)
        if token:
            query["pageToken"] = token
        body = await self.listing(f"{self.endpoint}/storage/v1/b/{self.bucket}/o?{urlencode(query)}", prefix)
        try:
            page = Fields(load_json(body, "listing"), "listing")
            objects = []
            for item in page.objects("items", []):
                size = _size(item.get("size"))
                # The generation, as the media endpoint's answers state it (its ETag is not this
                # API's): reads are checked against it (`HttpSource.read`).
                tag = generation_tag(item.get("generation")) or item.str("etag", default="")
                objects.append((item.str("name"), ObjectStat(size, _iso_ns(item.get("updated")), False, (tag, size))))
            prefixes = [as_str(p, "listing.prefixes[]") for p in page.list("prefixes", [])]
            following = page.get("nextPageToken")
            if following is not None:
                following = as_str(following, "listing.nextPageToken")
        except (ConfigError, ValueError) as e:  # MetadataError is a ConfigError
            raise SourceError(f"{self.where(prefix)}: malformed response ({e})") from e
        return objects, prefixes, following


class S3Source(_PrefixListing):
    scheme = "s3"

    def __init__(self, bucket: str, prefix: str, options: HttpOptions | None = None, endpoint: str | None = None,
                 region: str | None = None) -> None:
        check_bucket(bucket, self.scheme)
        self.region = aws_region(region)
        super().__init__(bucket, s3_bucket_url(bucket, self.region, endpoint), prefix, options)
        self._signer = _aws_signer(self.region)

    def is_absent(self, status: int) -> bool:
        # Without list permission S3 answers 403 for missing keys of a public bucket.
        return status in (403, 404, 410)

    async def authorize(self, request: h1.ClientRequest) -> None:
        if self._signer is not None:
            self._signer(request)

    async def page(self, prefix: str, limit: int | None, token: str | None
                   ) -> tuple[list[tuple[str, ObjectStat]], list[str], str | None]:
        # encoding-type=url: keys holding characters XML cannot carry (NUL, most controls) come
        # percent-encoded instead of breaking the whole page, as botocore asks for them too.
        query = {"list-type": "2", "prefix": prefix, "delimiter": "/", "encoding-type": "url"}
        if limit:
            query["max-keys"] = str(limit)
        if token:
            query["continuation-token"] = token
        body = await self.listing(f"{self.base_url}/?{urlencode(sorted(query.items()))}", prefix)
        try:
            root = ET.fromstring(body)
            ns = S3_NS if root.tag.startswith(S3_NS) else ""
            encoded = root.findtext(f"{ns}EncodingType") == "url"

            def name(element: ET.Element, tag: str) -> str:
                text = element.findtext(f"{ns}{tag}", "")
                # Undecodable bytes stay as surrogates, for `name_problem` to refuse.
                return unquote_plus(text, errors="surrogateescape") if encoded else text

            objects = []
            for item in root.iter(f"{ns}Contents"):
                size = _size(item.findtext(f"{ns}Size"))
                objects.append((name(item, "Key"), ObjectStat(
                    size, _iso_ns(item.findtext(f"{ns}LastModified")), False,
                    (item.findtext(f"{ns}ETag", ""), size))))
            prefixes = [name(p, "Prefix") for p in root.iter(f"{ns}CommonPrefixes")]
            truncated = root.findtext(f"{ns}IsTruncated", "false") == "true"
            following = root.findtext(f"{ns}NextContinuationToken") if truncated else None
        except (ET.ParseError, ValueError) as e:
            raise SourceError(f"{self.where(prefix)}: malformed response ({e})") from e
        return objects, prefixes, following


def _aws_signer(region: str) -> Callable[[h1.ClientRequest], None] | None:
    """A function signing read requests with SigV4, or None for anonymous access."""
    signature = aws_signature(region)
    if signature is None:
        return None

    def sign(request: h1.ClientRequest) -> None:
        signed = {k: v for k, v in request.headers.items() if k.lower() in ("range", "if-match")}
        request.headers.update(signature(request.method, str(request.url), signed, b""))
    return sign
