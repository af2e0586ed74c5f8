"""Fixtures of the scale-out tests: a local S3-compatible server (moto, loopback only)."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the whole test session; its URL.

    The AWS variables (endpoint, fake credentials) are put into ``os.environ`` so that
    processes started afterwards (Ray's raylets and workers) reach the same server.
    """
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env = {**S3_ENV, "AWS_ENDPOINT_URL": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield endpoint
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    """A fresh, empty bucket on the moto server; its name."""
    import boto3

    name = f"rec-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(autouse=True)
def _replay_cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``deskvm replay s3://...`` downloads under the temporary directory: the test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
