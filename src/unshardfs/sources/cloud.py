"""What reading (`sources.objectstore`) and writing (`dest.store`) GCS and S3 share.

Bucket names and the URLs they make, checked against the stores' naming
rules before anything connects; credentials from the stores' usual
environments when present, and what they add to a request:

- GCS: Application Default Credentials through google-auth, if installed and
  configured (a bearer token); otherwise anonymous requests.
- S3: the botocore credential chain (environment, shared config, instance
  roles) with SigV4 signing, if botocore is installed and finds credentials;
  otherwise anonymous requests.

Whoever sends a request decides where credentials may go (the store's own
endpoint only); this module only makes them.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from typing import Any, Callable

from unshardfs.util.errors import ConfigError

log = logging.getLogger(__name__)

GCS_ENDPOINT = "https://storage.googleapis.com"
# A page of 1000 names of 1 KiB each is ~1.5 MB; a larger one is refused, which
# also bounds what parsing one costs (~10x its size in Python objects).
LISTING_PAGE_LIMIT = 8 << 20

# The stores' bucket naming rules (S3: lowercase letters, digits, '.', '-'; GCS also '_'), both
# starting and ending with a letter or digit, at least 3 characters.
_BUCKET_NAME = {"s3": re.compile(r"[a-z0-9][a-z0-9.-]+[a-z0-9]"),
                "gs": re.compile(r"[a-z0-9][a-z0-9._-]+[a-z0-9]")}


def bucket_problem(bucket: str, scheme: str) -> str | None:
    """Why `bucket` is not a valid bucket name of the `scheme` ('s3' or 'gs') store, or None.

    Checked before anything connects: the name becomes part of a host name (S3)
    or URL path, where `127.0.0.1:9000#`, `a?b` or `a..b` would address
    another host, API or bucket.
    """
    longest = 222 if scheme == "gs" and "." in bucket else 63  # GCS: dotted names, 63 per part
    if not _BUCKET_NAME[scheme].fullmatch(bucket):
        allowed = "'.', '-'" + (", '_'" if scheme == "gs" else "")
        return (f"use 3 or more lowercase letters, digits, {allowed}, starting and ending with a letter or "
                "digit")
    if len(bucket) > longest or any(len(part) > 63 for part in bucket.split(".")):
        return f"longer than {longest} characters (or 63 between dots)"
    if ".." in bucket:
        return "two adjacent dots"
    try:
        ipaddress.ip_address(bucket)
    except ValueError:
        return None
    return "an IP address"


def check_bucket(bucket: str, scheme: str) -> None:
    """A one-line ConfigError for a name `bucket_problem` refuses."""
    problem = bucket_problem(bucket, scheme)
    if problem is not None:
        raise ConfigError(f"invalid {scheme}:// bucket name {bucket!r}: {problem}")


# The OAuth scopes credentials are asked for: reading a source, writing DEST.
GCS_READ = "https://www.googleapis.com/auth/devstorage.read_only"
GCS_WRITE = "https://www.googleapis.com/auth/devstorage.read_write"


def google_credentials(scope: str = GCS_READ) -> Any:  # google.auth's Credentials (untyped), or None
    """Google application default credentials for `scope`, if google-auth is installed and finds
    them; None (anonymous requests) otherwise."""
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
    except ImportError:
        return None
    try:
        creds, _project = google.auth.default(scopes=[scope])
    except DefaultCredentialsError:
        return None
    log.info("gs:// requests use Google application default credentials")
    return creds


def google_token(creds: Any) -> str:
    """A valid bearer token of google-auth credentials, refreshed first when needed (blocking)."""
    if not creds.valid:
        import google.auth.transport.requests

        creds.refresh(google.auth.transport.requests.Request())
    return str(creds.token)


S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def aws_region(region: str | None = None) -> str:
    """`region`, else the environment's (AWS_REGION, AWS_DEFAULT_REGION), else us-east-1."""
    return region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def s3_bucket_url(bucket: str, region: str, endpoint: str | None) -> str:
    """The URL a bucket's keys are appended to (after a '/')."""
    if endpoint:
        return f"{endpoint.rstrip('/')}/{bucket}"  # path style, as S3-compatible servers expect
    if "." in bucket:
        # Virtual-hosted names with dots fail TLS (the certificate is *.s3.<region>.amazonaws.com).
        return f"https://s3.{region}.amazonaws.com/{bucket}"
    return f"https://{bucket}.s3.{region}.amazonaws.com"


# What SigV4 adds to a request; the caller copies these onto what it sends.
SIGNATURE_HEADERS = ("Authorization", "X-Amz-Date", "X-Amz-Security-Token", "X-Amz-Content-SHA256")
# (method, url, headers to sign, body) -> the signature's headers
AwsSign = Callable[[str, str, "dict[str, str]", bytes], "dict[str, str]"]


def aws_signature(region: str) -> AwsSign | None:
    """A function computing SigV4 headers from the botocore credential chain, or None (anonymous)."""
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
    log.info("s3:// requests are signed with AWS credentials (%s)", getattr(credentials, "method", "?"))

    def signature(method: str, url: str, headers: dict[str, str], body: bytes) -> dict[str, str]:
        aws = AWSRequest(method=method, url=url, headers=headers, data=body)
        # refreshable credentials re-resolve on get_frozen_credentials()
        S3SigV4Auth(credentials.get_frozen_credentials(), "s3", region).add_auth(aws)
        return {name: aws.headers[name] for name in SIGNATURE_HEADERS if name in aws.headers}
    return signature


