"""The step's directory exists when ``save()`` returns, daemon or no daemon."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator import CheckpointClient
from orchestrator.protocol import LAYOUT_FILE
from tests.conftest import DaemonProcess

STEPS = range(1, 21)


def _write_layout(root: Path, tmp_prefix: str) -> None:
    """The layout file the daemon writes into each configured root at start."""
    info = {"path": str(root), "tmp_prefix": tmp_prefix, "final_prefix": "step_"}
    info["pointer"] = "latest"
    (root / LAYOUT_FILE).write_text(json.dumps(info))


@contextlib.contextmanager
def no_daemon(short_dir: Path, **kwargs: Any) -> Iterator[CheckpointClient]:
    """A client whose daemon is down.

    Its close does not wait for one to come up (5 s by default): what is under test
    here is done by then.
    """
    client = CheckpointClient(str(short_dir / "nobody.sock"), **kwargs)
    try:
        yield client
    finally:
        client.close(report_timeout=0.0)


@pytest.fixture
def stopped(
    daemon_factory: Callable[..., DaemonProcess],
) -> Iterator[Callable[[DaemonProcess], None]]:
    """SIGSTOP a daemon (it accepts nothing, answers nothing); SIGCONT it at teardown."""
    paused: list[DaemonProcess] = []

    def stop(daemon: DaemonProcess) -> None:
        assert daemon.proc is not None
        daemon.proc.send_signal(signal.SIGSTOP)
        paused.append(daemon)

    yield stop
    for daemon in paused:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.send_signal(signal.SIGCONT)


class TestPathExistsOnReturn:
    """``SaveHandle.path`` names an existing directory as soon as ``save()`` returns."""

    @pytest.mark.parametrize("wait", [True, False])
    def test_daemon_up(
        self, daemon_factory: Callable[..., DaemonProcess], root: Path, wait: bool
    ) -> None:
        daemon = daemon_factory([root])
        with CheckpointClient(str(daemon.socket_path), begin_timeout=10.0) as client:
            found = []
            for step in STEPS:
                handle = client.save(str(root), step, 0, 2, wait=wait)
                found.append(Path(handle.path).is_dir())
                assert handle.path == str(root / f"tmp_step_{step}")
                handle.seal()
        assert found == [True] * len(STEPS)

    @pytest.mark.parametrize("wait", [True, False])
    def test_daemon_down(self, short_dir: Path, root: Path, wait: bool) -> None:
        with no_daemon(short_dir, begin_timeout=60.0) as client:
            found = []
            for step in STEPS:
                handle = client.save(str(root), step, 0, 1, wait=wait)
                found.append(Path(handle.path).is_dir())
                assert handle.path == str(root / f"tmp_step_{step}")
                handle.seal()
        assert found == [True] * len(STEPS)

    def test_begin_creates_it_too(self, short_dir: Path, root: Path) -> None:
        with no_daemon(short_dir) as client:
            begun = client.begin(str(root), 3, 0, 1)
        assert Path(begun.path).is_dir()


class TestLayoutFile:
    """Without an acknowledged begin, the root's layout file names the directory."""

    def test_daemon_down_non_default_prefix(self, short_dir: Path, root: Path) -> None:
        _write_layout(root, "incoming-")
        with no_daemon(short_dir, begin_timeout=60.0) as client:
            assert client.step_path(str(root), 4) == str(root / "incoming-4")
            found = []
            for step in STEPS:
                handle = client.save(str(root), step, 0, 1, wait=False)
                assert handle.path == str(root / f"incoming-{step}")
                found.append(Path(handle.path).is_dir())
                handle.seal()
        assert found == [True] * len(STEPS)
        assert not list(root.glob("tmp_step_*"))

    def test_named_without_waiting_for_a_stopped_daemon(
        self,
        daemon_factory: Callable[..., DaemonProcess],
        root: Path,
        tmp_path: Path,
        stopped: Callable[[DaemonProcess], None],
    ) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(f'[[roots]]\npath = "{root}"\ntmp_prefix = "incoming-"\n')
        daemon = daemon_factory([], "--config", str(config))
        _write_layout(root, "incoming-")
        with CheckpointClient(str(daemon.socket_path), begin_timeout=60.0) as client:
            assert client.ping(10.0)
            stopped(daemon)
            # The daemon answers nothing, and this root never had a begin acknowledged:
            # the layout file is what names the directory (else save() would wait 60 s).
            handles = [client.save(str(root), step, 0, 2, wait=False) for step in STEPS]
            found = [Path(h.path).is_dir() for h in handles]
            assert [h.path for h in handles] == [str(root / f"incoming-{s}") for s in STEPS]
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGCONT)
            # The daemon agrees with the layout file: every save is acknowledged there.
            assert all(h.begun.acknowledged for h in handles)
            for handle in handles:
                handle.seal()
        assert found == [True] * len(STEPS)

    @pytest.mark.parametrize(
        "content",
        [
            "not json",
            '{"path": "/x"}',
            json.dumps({"path": "/x", "tmp_prefix": "../up-", "final_prefix": "s", "pointer": "l"}),
        ],
    )
    def test_unusable_layout_file_falls_back_to_the_default(
        self, short_dir: Path, root: Path, content: str
    ) -> None:
        (root / LAYOUT_FILE).write_text(content)
        with no_daemon(short_dir) as client:
            assert client.step_path(str(root), 1) is None
            handle = client.save(str(root), 1, 0, 1, wait=False)
            handle.seal()
        assert handle.path == str(root / "tmp_step_1")
        assert Path(handle.path).is_dir()
