"""A real Prometheus server scrapes a real daemon; its HTTP API reads the counters back."""

from __future__ import annotations

import json
import queue
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._system import require_tool
from tests.conftest import DaemonProcess, LineClient

pytestmark = pytest.mark.waits

TIMEOUT = 30.0
Start = Callable[..., DaemonProcess]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Prometheus:
    """``prometheus`` as a subprocess, its log lines readable in order."""

    def __init__(self, binary: str, workdir: Path, target: str) -> None:
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: ckptd\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put("")

    def wait_ready(self, timeout: float = TIMEOUT) -> None:
        """Until it logs that it serves its API (it says so once, on stderr)."""
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if not line:
                raise AssertionError(f"prometheus exited: {''.join(seen)}")
            seen.append(line)
            if "Server is ready to receive web requests" in line:
                return
        raise AssertionError(f"prometheus not ready within {timeout}s: {''.join(seen)}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        with urllib.request.urlopen(url, timeout=TIMEOUT) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@pytest.fixture
def prometheus_binary() -> str:
    return require_tool("prometheus")


@pytest.fixture
def scraper(prometheus_binary: str, tmp_path: Path) -> Iterator[Callable[[str], Prometheus]]:
    started: list[Prometheus] = []

    def make(target: str) -> Prometheus:
        server = Prometheus(prometheus_binary, tmp_path, target)
        started.append(server)
        server.wait_ready()
        return server

    yield make
    for server in started:
        server.close()


def until(fetch: Callable[[], Any], done: Callable[[Any], bool], timeout: float = TIMEOUT) -> Any:
    """``fetch()`` again until ``done`` says yes, within ``timeout``.

    Prometheus tells nobody when it has scraped: its API is asked again, every scrape
    interval at most, until the sample is there.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.25)


class TestPrometheus:
    """Prometheus reads ``ckptd_promotions_total`` and the gauges from a daemon it scrapes."""

    def test_promotions_read_back_through_the_api(
        self, start: Start, root: Path, scraper: Callable[[str], Prometheus]
    ) -> None:
        daemon = start([root], "--metrics-listen", "127.0.0.1:0")
        port = daemon.wait_event("metrics.listening", TIMEOUT)["port"]
        prometheus = scraper(f"127.0.0.1:{port}")
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            for step in (1, 2):
                client.request("begin", root=str(root), step=step, rank=0, world_size=1)
                (root / f"tmp_step_{step}" / "w.bin").write_bytes(b"w" * 10)
                files = [{"path": "w.bin", "size": 10}]
                client.request("done", root=str(root), step=step, rank=0, files=files)
                reply = client.request("wait", root=str(root), step=step, timeout=TIMEOUT)
                assert reply["state"] == "promoted"
        expr = f'ckptd_promotions_total{{job="ckptd",root="{root}"}}'
        result = until(lambda: prometheus.query(expr), lambda r: r and r[0]["value"][1] == "2")
        assert [float(r["value"][1]) for r in result] == [2.0]
        assert result[0]["metric"]["instance"] == f"127.0.0.1:{port}"
        up = prometheus.query('up{job="ckptd"}')
        assert up[0]["value"][1] == "1"
        age = prometheus.query(f'time() - ckptd_last_promotion_timestamp_seconds{{root="{root}"}}')
        assert 0 <= float(age[0]["value"][1]) < TIMEOUT
        info = prometheus.query("ckptd_build_info")
        assert info[0]["metric"]["version"]
        assert daemon.stop() == 0
