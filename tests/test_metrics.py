"""Prometheus metrics: what a scrape of a real daemon says, and the textfile it writes."""

from __future__ import annotations

import shutil
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.ops._metrics import FAILURE_REASONS, failure_reason
from daemon.ops._retention_metrics import KEPT_REASONS
from daemon.server._server import VERSION
from tests._fuse import bindfs_mount
from tests.conftest import DaemonProcess, LineClient
from tests.test_retention import promote, settle
from tests.test_server import of

pytestmark = pytest.mark.waits

TIMEOUT = 15.0
Start = Callable[..., DaemonProcess]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

BOUNDED_LABELS = {"root", "reason", "code", "version", "le", "result"}
"""Every label a ckptd_* series may carry: none names a step, rank, path or free text."""


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def scrape(port: int) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT) as r:
        text = r.read().decode()
    return text, parse(text)


def metrics_port(daemon: DaemonProcess) -> int:
    port: int = daemon.wait_event("metrics.listening", TIMEOUT)["port"]
    return port


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply.get("ok") is True, reply
    return reply


def save(client: LineClient, root: Path, step: int, *, fail: bool = False) -> dict[str, Any]:
    ok(client.request("begin", root=str(root), step=step, rank=0, world_size=1))
    if fail:
        ok(client.request("fail", root=str(root), step=step, rank=0, reason="disk full"))
    else:
        (root / f"tmp_step_{step}" / "w.bin").write_bytes(b"w" * 1000)
        files = [{"path": "w.bin", "size": 1000}]
        ok(client.request("done", root=str(root), step=step, rank=0, files=files))
    return client.request("wait", root=str(root), step=step, timeout=TIMEOUT)


class TestFailureReason:
    """A failure's free-text reason becomes one of a few fixed classes."""

    @pytest.mark.parametrize(
        ("reason", "expected"),
        [
            ("rank 3 failed: CUDA error", "writer_failed"),
            ("rank 0 disconnected and did not reconnect within its 30s lease", "lease_expired"),
            ("timed out after 3600s; ranks not done: [1]", "timeout"),
            ("verification failed: model/.metadata missing", "verification"),
            ("promotion failed: fsync of /r failed: EIO", "promotion"),
            ("promotion not started: the change could not be made durable", "journal"),
            ("internal error: KeyError('x')", "internal"),
            ("something new", "other"),
        ],
    )
    def test_classes(self, reason: str, expected: str) -> None:
        assert failure_reason(reason) == expected
        assert expected in FAILURE_REASONS


class TestScrape:
    """``--metrics-listen`` serves the daemon's counters, histograms and gauges."""

    def test_promotion_and_failure_counted(self, start: Start, root: Path) -> None:
        daemon = start([root], "--metrics-listen", "127.0.0.1:0")
        port = metrics_port(daemon)
        r = (("root", str(root)),)
        _, before = scrape(port)
        assert before[("ckptd_build_info", (("version", VERSION),))] == 1
        assert before[("ckptd_saves_in_flight", r)] == 0
        assert ("ckptd_last_promotion_timestamp_seconds", r) not in before
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            ok(client.request("begin", root=str(root), step=1, rank=0, world_size=1))
            _, during = scrape(port)
            assert during[("ckptd_saves_in_flight", r)] == 1
            assert during[("ckptd_connections_open", ())] >= 1
            (root / "tmp_step_1" / "w.bin").write_bytes(b"w" * 1000)
            files = [{"path": "w.bin", "size": 1000}]
            ok(client.request("done", root=str(root), step=1, rank=0, files=files))
            assert client.request("wait", root=str(root), step=1, timeout=TIMEOUT)["state"] == (
                "promoted"
            )
            assert save(client, root, 2, fail=True)["state"] == "failed"
            client.request("no-such-op")
        promoted_at = time.time()
        text, after = scrape(port)
        assert after[("ckptd_promotions_total", r)] == 1
        assert after[("ckptd_promoted_bytes_total", r)] == 1000
        assert after[("ckptd_promotion_duration_seconds_count", r)] == 1
        assert after[("ckptd_save_duration_seconds_count", r)] == 1
        assert after[("ckptd_failures_total", (("reason", "writer_failed"), *r))] == 1
        assert after[("ckptd_requests_rejected_total", (("code", "unknown_op"),))] >= 1
        assert after[("ckptd_saves_in_flight", r)] == 0
        stamp = after[("ckptd_last_promotion_timestamp_seconds", r)]
        assert promoted_at - 30 < stamp <= promoted_at
        assert after[("ckptd_journal_flush_duration_seconds_count", ())] >= 2
        assert after[("ckptd_connections_total", ())] == 1
        assert after[("ckptd_root_stalled", r)] == 0
        assert after[("ckptd_journal_stalled", ())] == 0
        assert after[("ckptd_journal_errors_total", ())] == 0
        assert after[("ckptd_config_last_reload_successful", ())] == 1
        assert "process_resident_memory_bytes" in text
        for name, labels in after:
            if name.startswith("ckptd_"):
                assert {k for k, _ in labels} <= BOUNDED_LABELS, (name, labels)
        assert daemon.stop() == 0

    def test_last_promotion_survives_a_restart(
        self, start: Start, root: Path, short_dir: Path
    ) -> None:
        state = short_dir / "state"
        extra = ("--metrics-listen", "127.0.0.1:0", "--state-dir", str(state))
        daemon = start([root], *extra)
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            assert save(client, root, 1)["state"] == "promoted"
        _, first = scrape(metrics_port(daemon))
        assert daemon.stop() == 0
        again = start([root], *extra, socket_name="d2.sock")
        _, second = scrape(metrics_port(again))
        key = ("ckptd_last_promotion_timestamp_seconds", (("root", str(root)),))
        assert abs(second[key] - first[key]) < 1.0  # from the journal, not the restart
        # The counter starts again from zero (it is no journal fact); its series is there
        # from the start, so that an alert on no increase can fire for any root.
        assert second[("ckptd_promotions_total", (("root", str(root)),))] == 0.0
        assert again.stop() == 0

    def test_port_in_use_is_a_clear_error(self, start: Start, root: Path) -> None:
        daemon = start([root], "--metrics-listen", "127.0.0.1:0")
        port = metrics_port(daemon)
        with pytest.raises(AssertionError, match="cannot serve metrics on 127.0.0.1"):
            start([root], "--metrics-listen", f"127.0.0.1:{port}", socket_name="d2.sock")


class TestStalls:
    """A hung root shows as ``ckptd_root_stalled`` 1 while it hangs, 0 once it answers."""

    def test_stalled_root_gauge(self, start: Start, tmp_path: Path) -> None:
        backing = tmp_path / "backing"
        backing.mkdir()
        cfg = tmp_path / "c.toml"
        cfg.write_text('fs_stall_after = 0.5\nmetrics_listen = "127.0.0.1:0"\n')
        with bindfs_mount(backing, tmp_path / "root") as fs:
            daemon = start([fs.mount], "--config", str(cfg))
            port = metrics_port(daemon)
            r = (("root", str(fs.mount)),)
            fs.stop()
            with LineClient(daemon.socket_path, timeout=TIMEOUT) as asker:
                asker.send_raw(b'{"op":"latest","id":1,"root":"%s"}\n' % str(fs.mount).encode())
                daemon.wait_event("root.stalled", TIMEOUT)
                _, hung = scrape(port)  # answered while the root hangs
                assert hung[("ckptd_root_stalled", r)] == 1
                assert hung[("ckptd_root_stalls_total", r)] == 1
                assert hung[("ckptd_journal_stalled", ())] == 0
                fs.cont()
                assert asker.recv()["id"] == 1
            daemon.wait_event("root.recovered", TIMEOUT)
            _, after = scrape(port)
            assert after[("ckptd_root_stalled", r)] == 0
            assert daemon.stop() == 0


class TestTextfile:
    """``metrics_textfile`` is replaced by a rename, never written in place."""

    def test_written_for_node_exporter(self, start: Start, root: Path, tmp_path: Path) -> None:
        out = tmp_path / "textfile"
        out.mkdir()
        prom = out / "ckptd.prom"
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'metrics_textfile = "{prom}"\n')
        daemon = start([root], "--config", str(cfg))
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            assert save(client, root, 1)["state"] == "promoted"
        assert daemon.stop() == 0  # the last write happens on the way out
        samples = parse(prom.read_text())
        assert samples[("ckptd_promotions_total", (("root", str(root)),))] == 1
        assert [p.name for p in out.iterdir()] == ["ckptd.prom"]  # no temporary left

    def test_unwritable_directory_is_reported(
        self, start: Start, root: Path, tmp_path: Path
    ) -> None:
        prom = tmp_path / "missing" / "ckptd.prom"
        cfg = tmp_path / "c.toml"
        cfg.write_text(f'metrics_textfile = "{prom}"\n')
        daemon = start([root], "--config", str(cfg))
        failed = daemon.wait_event("metrics.textfile_failed", TIMEOUT)
        assert failed["path"] == str(prom) and failed["level"] == "warning"
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            assert ok(client.request("ping"))  # the daemon serves on
        (tmp_path / "missing").mkdir()
        daemon.wait_event("metrics.textfile_recovered", TIMEOUT)
        assert prom.exists()
        assert daemon.stop() == 0


class TestRetention:
    """Retention's counters, and its last pass's gauges, from a real daemon's passes."""

    def test_retired_kept_and_errors(self, start: Start, root: Path, tmp_path: Path) -> None:
        cfg = tmp_path / "c.toml"
        cfg.write_text(
            f'metrics_listen = "127.0.0.1:0"\n[[roots]]\npath = "{root}"\n'
            "[roots.retention]\nkeep_last = 2\n"
        )
        daemon = start([], "--config", str(cfg))
        port = metrics_port(daemon)
        r = (("root", str(root)),)
        _, before = scrape(port)  # at 0 from the start: "nothing retired" can fire
        assert before[("ckptd_retention_retired_total", r)] == 0
        assert before[("ckptd_retention_errors_total", r)] == 0
        for step in (1, 2, 3):
            promote(daemon, root, step)
        daemon.wait_event("checkpoint.deleted", TIMEOUT, of(root, 1))
        settle(daemon, root)  # a pass whose report the scrape reads
        _, after = scrape(port)
        assert after[("ckptd_retention_retired_total", r)] == 1
        # The 2 ranks' 400 bytes of files, and the daemon's own (manifest, markers).
        assert after[("ckptd_retention_deleted_bytes_total", r)] > 400
        assert after[("ckptd_retention_checkpoints", r)] == 2
        kept = {
            dict(labels)["reason"]: value
            for (name, labels), value in after.items()
            if name == "ckptd_retention_kept"
        }
        assert kept == {**dict.fromkeys(KEPT_REASONS, 0), "newest": 1, "latest": 1, "keep_last": 2}
        assert after[("ckptd_retention_prunes", r)] == 1
        assert abs(after[("ckptd_retention_last_pass_timestamp_seconds", r)] - time.time()) < 60
        avail = after[("ckptd_root_filesystem_avail_bytes", r)]
        assert 0 < avail <= after[("ckptd_root_filesystem_size_bytes", r)]
        # The trash cannot be made (a file where its directory goes): the next pass that
        # would retire a step fails.
        shutil.rmtree(root / ".ckptd-trash")
        (root / ".ckptd-trash").write_text("in the way")
        promote(daemon, root, 4)
        daemon.wait_event("retention.failed", TIMEOUT, lambda e: e["root"] == str(root))
        _, failed = scrape(port)
        assert failed[("ckptd_retention_errors_total", r)] == 1
        assert failed[("ckptd_retention_retired_total", r)] == 1
        for name, labels in failed:
            if name.startswith("ckptd_"):
                assert {k for k, _ in labels} <= BOUNDED_LABELS, (name, labels)
