"""Google Cloud Storage and S3 (and S3-compatible stores) as listable HTTP sources.

Objects are read with the same ranged GETs as any HTTP source; what the
stores add is listing (GCS JSON API `objects.list`, S3 `ListObjectsV2`, both
with a `/` delimiter so "directories" are common prefixes) and credentials
from their usual environments when present:

- GCS: Application Default Credentials through google-auth, if installed and
  configured; otherwise anonymous requests (public buckets).
- S3: the botocore credential chain (environment, shared config, instance
  roles) with SigV4 signing, if botocore is installed and finds credentials;
  otherwise anonymous requests.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import xml.etree.ElementTree as ET
from typing import AsyncIterator
from urllib.parse import quote, urlencode

import httpx
import trio

from ..errors import ConfigError, SourceError
from .base import ObjectStat
from .http import HttpOptions, HttpSource

log = logging.getLogger(__name__)


def _iso_ns(value: str | None) -> int:
    if not value:
        return 0
    try:
        return int(datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
    except ValueError:
        return 0


class _PrefixListing(HttpSource):
    """Shared logic: a store under `<bucket>/<prefix>` listed page by page."""

    listable = True

    def __init__(self, base_url: str, prefix: str, options: HttpOptions | None, description: str) -> None:
        super().__init__(base_url, options, description)
        self.prefix = prefix.strip("/")

    def full_key(self, key: str) -> str:
        return "/".join(p for p in (self.prefix, key) if p)

    def object_url(self, key: str) -> str:
        return f"{self.base_url}/{quote(self.full_key(key))}"

    async def page(self, prefix: str, limit: int | None, token: str | None
                   ) -> tuple[list[tuple[str, ObjectStat]], list[str], str | None]:
        """One page of the listing: (objects, sub-prefixes, token of the next page or None)."""
        raise NotImplementedError

    async def listing(self, url: str, prefix: str) -> httpx.Response:
        response = await self.request("GET", url)
        if response.status_code >= 400:
            raise SourceError(f"listing {self.description}/{prefix}: HTTP {response.status_code}")
        return response

    async def pages(self, prefix: str, limit: int | None
                    ) -> AsyncIterator[tuple[list[tuple[str, ObjectStat]], list[str]]]:
        """(objects, sub-prefixes) directly under `prefix` (ending in '/'), page by page."""
        token = None
        while True:
            objects, prefixes, token = await self.page(prefix, limit, token)
            yield objects, prefixes
            if not token or limit:
                return

    async def list(self, key: str) -> AsyncIterator[tuple[str, ObjectStat]]:  # type: ignore[override]
        full = self.full_key(key)
        prefix = f"{full}/" if full else ""
        async for objects, prefixes in self.pages(prefix, None):
            for name in prefixes:
                child = name[len(prefix):].rstrip("/")
                if child:
                    yield child, ObjectStat(0, 0, True)
            for name, st in objects:
                child = name[len(prefix):]
                if child and "/" not in child:
                    self._stats[self._relative(name)] = st
                    yield child, st

    def _relative(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    async def stat_dir(self, key: str) -> ObjectStat | None:
        if not key:
            return ObjectStat(0, 0, True)
        async for objects, prefixes in self.pages(f"{self.full_key(key)}/", 1):
            return ObjectStat(0, 0, True) if objects or prefixes else None
        return None


class GcsSource(_PrefixListing):
    def __init__(self, bucket: str, prefix: str, options: HttpOptions | None = None,
                 endpoint: str = "https://storage.googleapis.com") -> None:
        self.endpoint = endpoint.rstrip("/")
        self.bucket = bucket
        super().__init__(f"{self.endpoint}/{quote(bucket)}", prefix, options, f"gs://{bucket}/{prefix}".rstrip("/"))
        self._credentials = _google_credentials()

    async def authorize(self, request: httpx.Request) -> None:
        creds = self._credentials
        if creds is None:
            return
        if not creds.valid:
            import google.auth.transport.requests

            await trio.to_thread.run_sync(creds.refresh, google.auth.transport.requests.Request())
        request.headers["Authorization"] = f"Bearer {creds.token}"

    async def page(self, prefix: str, limit: int | None, token: str | None
                   ) -> tuple[list[tuple[str, ObjectStat]], list[str], str | None]:
        query = {"prefix": prefix, "delimiter": "/", "fields": "items(name,size,updated,etag),prefixes,nextPageToken"}
        if limit:
            query["maxResults"] = str(limit)
        if token:
            query["pageToken"] = token
        response = await self.listing(f"{self.endpoint}/storage/v1/b/{quote(self.bucket)}/o?{urlencode(query)}",
                                      prefix)
        try:
            page = json.loads(response.content)
            objects = [(item["name"], ObjectStat(int(item["size"]), _iso_ns(item.get("updated")), False,
                                                 (item.get("etag", ""), int(item["size"]))))
                       for item in page.get("items", [])]
        except (ValueError, KeyError, TypeError) as e:
            raise SourceError(f"listing gs://{self.bucket}/{prefix}: malformed response ({e})") from e
        return objects, list(page.get("prefixes", [])), page.get("nextPageToken")


def _google_credentials():
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
    except ImportError:
        return None
    try:
        creds, _project = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_only"])
    except DefaultCredentialsError:
        return None
    log.info("gs:// requests use Google application default credentials")
    return creds


S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class S3Source(_PrefixListing):
    def __init__(self, bucket: str, prefix: str, options: HttpOptions | None = None, endpoint: str | None = None,
                 region: str | None = None) -> None:
        self.region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        if endpoint:
            base = f"{endpoint.rstrip('/')}/{quote(bucket)}"  # path style, as S3-compatible servers expect
        else:
            base = f"https://{bucket}.s3.{self.region}.amazonaws.com"
        super().__init__(base, prefix, options, f"s3://{bucket}/{prefix}".rstrip("/"))
        self.bucket = bucket
        self._signer = _aws_signer(self.region)

    def is_absent(self, status: int) -> bool:
        # Without list permission S3 answers 403 for missing keys of a public bucket.
        return status in (403, 404, 410)

    async def authorize(self, request: httpx.Request) -> None:
        if self._signer is not None:
            self._signer(request)

    async def page(self, prefix: str, limit: int | None, token: str | None
                   ) -> tuple[list[tuple[str, ObjectStat]], list[str], str | None]:
        query = {"list-type": "2", "prefix": prefix, "delimiter": "/"}
        if limit:
            query["max-keys"] = str(limit)
        if token:
            query["continuation-token"] = token
        response = await self.listing(f"{self.base_url}/?{urlencode(sorted(query.items()))}", prefix)
        try:
            root = ET.fromstring(response.content)
            ns = S3_NS if root.tag.startswith(S3_NS) else ""
            objects = []
            for item in root.iter(f"{ns}Contents"):
                size = int(item.findtext(f"{ns}Size", "0"))
                objects.append((item.findtext(f"{ns}Key", ""), ObjectStat(
                    size, _iso_ns(item.findtext(f"{ns}LastModified")), False,
                    (item.findtext(f"{ns}ETag", ""), size))))
            prefixes = [p.findtext(f"{ns}Prefix", "") for p in root.iter(f"{ns}CommonPrefixes")]
            truncated = root.findtext(f"{ns}IsTruncated", "false") == "true"
            following = root.findtext(f"{ns}NextContinuationToken") if truncated else None
        except (ET.ParseError, ValueError) as e:
            raise SourceError(f"listing s3://{self.bucket}/{prefix}: malformed response ({e})") from e
        return objects, prefixes, following


def _aws_signer(region: str):
    """A function signing httpx requests with SigV4, or None for anonymous access."""
    try:
        import botocore.session
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
    except ImportError:
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            raise ConfigError("AWS credentials are set but botocore is not installed to sign requests "
                              "(pip install botocore)")
        return None
    credentials = botocore.session.get_session().get_credentials()
    if credentials is None:
        return None
    frozen = credentials  # refreshable credentials re-resolve on get_frozen_credentials()
    log.info("s3:// requests are signed with AWS credentials (%s)", getattr(credentials, "method", "?"))

    def sign(request: httpx.Request) -> None:
        aws = AWSRequest(method=request.method, url=str(request.url),
                         headers={k: v for k, v in request.headers.items() if k.lower() in ("range", "if-match")})
        S3SigV4Auth(frozen.get_frozen_credentials(), "s3", region).add_auth(aws)
        for name in ("Authorization", "X-Amz-Date", "X-Amz-Security-Token", "X-Amz-Content-SHA256"):
            if name in aws.headers:
                request.headers[name] = aws.headers[name]
    return sign
