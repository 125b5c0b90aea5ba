"""An S3 emulator for the tests: moto's server on 127.0.0.1, always stopped."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import pytest

# What botocore's credential chain (and our S3 signer) picks up.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def moto_s3() -> Iterator[tuple[str, Any]]:
    """(endpoint URL, boto3 client) of a fresh moto S3 server; set CREDENTIALS in the environment first."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        yield endpoint, boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    finally:
        server.stop()


def upload(client: Any, bucket: str, root: Path, prefix: str = "") -> None:
    """Every file under `root` as an object of a new `bucket`, keyed by its relative path under `prefix`."""
    client.create_bucket(Bucket=bucket)
    for path in root.rglob("*"):
        if path.is_file():
            key = str(path.relative_to(root))
            client.put_object(Bucket=bucket, Key=f"{prefix}/{key}" if prefix else key, Body=path.read_bytes())


@pytest.fixture
def s3_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Any]]:
    """A fresh moto S3 server for one test, with CREDENTIALS in its environment (import it into a test
    module to use it)."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    with moto_s3() as server:
        yield server
