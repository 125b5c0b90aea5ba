"""S3 and GCS buckets in memory, answered through `httpx.MockTransport`: the unit tests of DEST's
object store client (`tests/dest/`). No socket, no thread: every request is answered in the calling
thread and logged, and a test can answer any request itself first (`fault`: an outage, a 412, a
lying checksum, a repeated page token)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import parse_qs, quote, unquote, urlsplit

import crc32c
import httpx

from unshardfs.testing.http_servers import delimited

S3_ENDPOINT = "http://s3.test"
GCS_ENDPOINT = "http://gcs.test"

Fault = Callable[[httpx.Request], "httpx.Response | None"]


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _range(request: httpx.Request, data: bytes) -> httpx.Response | None:
    """The ranged answer a Range header asks of `data` (None: no Range)."""
    wanted = request.headers.get("range")
    if wanted is None:
        return None
    m = re.fullmatch(r"bytes=(\d*)-(\d*)", wanted)
    assert m, wanted
    if m.group(1) == "":
        first = max(0, len(data) - int(m.group(2)))
        last = len(data) - 1
    else:
        first, last = int(m.group(1)), min(int(m.group(2) or len(data) - 1), len(data) - 1)
    if first >= len(data):
        return httpx.Response(416)
    return httpx.Response(206, content=data[first:last + 1],
                          headers={"content-range": f"bytes {first}-{last}/{len(data)}"})


@dataclass
class MockStore:
    """What both mocks share: the objects (key -> bytes), the request log, the fault hook, and the
    page size of listings."""

    bucket: str = "bkt"
    page: int = 2
    objects: dict[str, bytes] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)
    fault: Fault | None = None

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self._answer)

    def _answer(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        answer = self.fault(request) if self.fault is not None else None
        if answer is None:
            answer = self.handle(request)
        # As a server's: a body to stream (one made with `content=` counts as read already).
        return httpx.Response(answer.status_code, headers=answer.headers, stream=httpx.ByteStream(answer.content))

    def handle(self, request: httpx.Request) -> httpx.Response:
        raise NotImplementedError

    def sent(self, method: str | None = None) -> list[httpx.Request]:
        return [r for r in self.requests if method is None or r.method == method]

    def listed(self, prefix: str, delimiter: str, start: int) -> tuple[list[str], list[str], int | None]:
        """(keys, common prefixes) of one page from `start`, and where the next page starts."""
        names = delimited(sorted(self.objects), prefix, delimiter)
        page = names[start:start + self.page]
        following = start + self.page if start + self.page < len(names) else None
        return [n for n, d in page if not d], [n for n, d in page if d], following


class MockS3(MockStore):
    """A bucket at `S3_ENDPOINT/bkt`: conditional PUTs (If-None-Match, If-Match) answered with the
    body's MD5 as ETag and its CRC-32C echoed, HEAD, ranged GET, DELETE, ListObjectsV2 in pages of
    `page` names (tokens "t<index>"), and an empty list of unfinished uploads."""

    def etag(self, data: bytes) -> str:
        return f'"{hashlib.md5(data).hexdigest()}"'

    @staticmethod
    def error(status: int, code: str) -> httpx.Response:
        return httpx.Response(status, content=f"<Error><Code>{code}</Code></Error>".encode())

    def handle(self, request: httpx.Request) -> httpx.Response:
        url = urlsplit(str(request.url))
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        head = f"/{self.bucket}/"
        assert url.path.startswith(head), url.path
        key = unquote(url.path[len(head):])
        if request.method == "GET" and not key:
            if "uploads" in query:
                return httpx.Response(200, content=b"<ListMultipartUploadsResult><IsTruncated>false</IsTruncated>"
                                                   b"</ListMultipartUploadsResult>")
            return self.list_page(query)
        data = self.objects.get(key)
        if request.method == "PUT":
            body = request.content
            if base64.b64decode(request.headers["content-md5"]) != hashlib.md5(body).digest():
                return self.error(400, "BadDigest")
            if request.headers.get("if-none-match") == "*" and data is not None:
                return self.error(412, "PreconditionFailed")
            wanted = request.headers.get("if-match")
            if wanted is not None and (data is None or self.etag(data) != wanted):
                return self.error(412, "PreconditionFailed")
            self.objects[key] = body
            return httpx.Response(200, headers={"etag": self.etag(body),
                                                "x-amz-checksum-crc32c": _b64(crc32c.crc32c(body).to_bytes(4, "big"))})
        if data is None:
            return self.error(404, "NoSuchKey")
        if request.method == "HEAD":
            return httpx.Response(200, headers={"content-length": str(len(data)), "etag": self.etag(data),
                                                "x-amz-checksum-crc32c": _b64(crc32c.crc32c(data).to_bytes(4, "big"))})
        if request.method == "GET":
            return _range(request, data) or httpx.Response(200, content=data)
        if request.method == "DELETE":
            del self.objects[key]
            return httpx.Response(204)
        raise AssertionError(f"{request.method} {request.url}")

    def list_page(self, query: dict[str, str]) -> httpx.Response:
        token = query.get("continuation-token", "")
        start = int(token[1:]) if token[1:].isdigit() else self.page if token else 0
        keys, prefixes, following = self.listed(query.get("prefix", ""), query.get("delimiter", ""), start)
        body = "<ListBucketResult><EncodingType>url</EncodingType>"
        body += "".join(f"<Contents><Key>{quote(k)}</Key><Size>{len(self.objects[k])}</Size></Contents>" for k in keys)
        body += "".join(f"<CommonPrefixes><Prefix>{quote(p)}</Prefix></CommonPrefixes>" for p in prefixes)
        body += f"<IsTruncated>{'true' if following is not None else 'false'}</IsTruncated>"
        if following is not None:
            body += f"<NextContinuationToken>t{following}</NextContinuationToken>"
        return httpx.Response(200, content=(body + "</ListBucketResult>").encode())


@dataclass
class MockGcs(MockStore):
    """A bucket at `GCS_ENDPOINT` through the JSON API: media uploads with ifGenerationMatch, object
    resources (size, crc32c, generation), alt=media reads, DELETE, listings in pages of `page`
    names (tokens "p<index>")."""

    generations: dict[str, int] = field(default_factory=dict)

    def resource(self, key: str) -> httpx.Response:
        data = self.objects[key]
        return httpx.Response(200, json={"name": key, "size": str(len(data)), "generation": str(self.generations.get(key, 1)),
                                         "crc32c": _b64(crc32c.crc32c(data).to_bytes(4, "big"))})

    def handle(self, request: httpx.Request) -> httpx.Response:
        url = urlsplit(str(request.url))
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        objects = f"/storage/v1/b/{self.bucket}/o"
        if url.path == f"/upload{objects}" and request.method == "POST":
            key = query["name"]
            wanted = query.get("ifGenerationMatch")
            if wanted is not None and str(self.generations.get(key, 1) if key in self.objects else 0) != wanted:
                return httpx.Response(412, json={"error": {"message": "conditionNotMet"}})
            self.generations[key] = (self.generations.get(key, 1) if key in self.objects else 0) + 1
            self.objects[key] = request.content
            return self.resource(key)
        if url.path == objects and request.method == "GET":
            token = query.get("pageToken", "")
            start = int(token[1:]) if token[1:].isdigit() else self.page if token else 0
            keys, prefixes, following = self.listed(query.get("prefix", ""), query.get("delimiter", ""), start)
            doc: dict[str, object] = {"items": [{"name": k, "size": str(len(self.objects[k]))} for k in keys],
                                      "prefixes": prefixes}
            if following is not None:
                doc["nextPageToken"] = f"p{following}"
            return httpx.Response(200, content=json.dumps(doc).encode())
        assert url.path.startswith(objects + "/"), url.path
        key = unquote(url.path[len(objects) + 1:])
        if key not in self.objects:
            return httpx.Response(404, json={"error": {"message": "Not Found"}})
        if request.method == "DELETE":
            del self.objects[key]
            return httpx.Response(204)
        if query.get("alt") == "media":
            data = self.objects[key]
            return _range(request, data) or httpx.Response(200, content=data)
        return self.resource(key)
