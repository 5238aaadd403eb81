"""SIGHUP reload: what changes (a pure diff) and what a real daemon does with it."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.base._errors import RequestError
from daemon.config._config import Config, RootConfig
from daemon.ops._reload import LIVE, plan_reload, refusal, reloaded_root_check, summary
from orchestrator.protocol import ErrorCode
from tests._system import require_root
from tests.conftest import DaemonProcess, LineClient
from tests.test_metrics import Samples, scrape

TIMEOUT = 15.0
Start = Callable[..., DaemonProcess]


def root_config(path: Path, **options: Any) -> RootConfig:
    return RootConfig(path=str(path), real=str(path), **options)


def config(tmp_path: Path, *roots: RootConfig, **fields: Any) -> Config:
    return Config(roots=roots, state_dir=str(tmp_path / "state"), **fields)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class _RootWithRetention(RootConfig):
    """A root option this module's plan was not written for."""

    keep_last: int = 0


@dataclasses.dataclass(kw_only=True, slots=True)
class _ConfigWithNode(Config):
    """A top-level option this module's plan was not written for."""

    node: str = ""


class TestPlan:
    """``plan_reload`` compares every field; only the live ones change at once."""

    def test_nothing_changed(self, tmp_path: Path) -> None:
        a = root_config(tmp_path)
        assert plan_reload(config(tmp_path, a), config(tmp_path, a)).empty

    def test_roots_added_removed_changed(self, tmp_path: Path) -> None:
        a, b, c = (root_config(tmp_path / n) for n in "abc")
        b2 = dataclasses.replace(b, pointer="newest")
        plan = plan_reload(config(tmp_path, a, b), config(tmp_path, b2, c))
        assert plan.added == (c,) and plan.removed == (a,)
        assert [(ch.old, ch.new, ch.fields) for ch in plan.changed] == [(b, b2, ("pointer",))]
        assert plan.changed[0].layout
        assert plan.config.roots == (b2, c)

    def test_restart_fields_keep_their_old_value(self, tmp_path: Path) -> None:
        a = root_config(tmp_path)
        old = config(tmp_path, a, socket_mode=0o660, log_level="info", root_threads=8)
        new = config(tmp_path, a, socket_mode=0o600, log_level="debug", root_threads=2)
        plan = plan_reload(old, new)
        assert plan.live == ("log_level",)
        assert plan.restart == ("root_threads", "socket_mode")
        assert plan.config.log_level == "debug"
        assert (plan.config.socket_mode, plan.config.root_threads) == (0o660, 8)
        assert summary(plan)["restart_required"] == ["root_threads", "socket_mode"]

    def test_allow_lists_are_live(self, tmp_path: Path) -> None:
        a = root_config(tmp_path)
        plan = plan_reload(
            config(tmp_path, a), config(tmp_path, a, allowed_uids=(0, 7), allowed_gids=(9,))
        )
        assert set(plan.live) == {"allowed_uids", "allowed_gids"} and not plan.restart
        assert {"allowed_uids", "allowed_gids", "log_level", "roots"} <= LIVE

    def test_fields_added_later_are_compared(self, tmp_path: Path) -> None:
        """A root option added later reloads; a top-level one added later needs a restart."""
        a = _RootWithRetention(path=str(tmp_path), real=str(tmp_path), keep_last=3)
        b = dataclasses.replace(a, keep_last=5)
        old = _ConfigWithNode(roots=(a,), state_dir=str(tmp_path / "s"), node="n1")
        new = _ConfigWithNode(roots=(b,), state_dir=str(tmp_path / "s"), node="n2")
        plan = plan_reload(old, new)
        assert [c.fields for c in plan.changed] == [("keep_last",)]
        assert plan.config.roots == (b,) and not plan.changed[0].layout
        assert plan.restart == ("node",)
        assert isinstance(plan.config, _ConfigWithNode) and plan.config.node == "n1"

    def test_layout_change_refused_while_saves_are_in_flight(self, tmp_path: Path) -> None:
        a = root_config(tmp_path)
        plan = plan_reload(
            config(tmp_path, a), config(tmp_path, dataclasses.replace(a, tmp_prefix="wip_"))
        )
        problem = refusal(plan, {a.path: 2})
        assert problem is not None and "tmp_prefix cannot change while 2 save(s)" in problem
        assert refusal(plan, {}) is None


class TestBeginAcrossAReload:
    """A begin that looked its root up before a reload is checked again before it lands."""

    def test_removed_or_renamed_root_refused(self, tmp_path: Path) -> None:
        a, b = root_config(tmp_path / "a"), root_config(tmp_path / "b")
        now = config(tmp_path, a)
        reloaded_root_check(now, {}, a)  # unchanged: admitted
        with pytest.raises(RequestError) as removed:
            reloaded_root_check(now, {}, b)
        assert removed.value.code is ErrorCode.ROOT_NOT_CONFIGURED
        with pytest.raises(RequestError) as retiring:
            reloaded_root_check(config(tmp_path, a, b), {b.path: b}, b)
        assert retiring.value.code is ErrorCode.ROOT_NOT_CONFIGURED
        renamed = config(tmp_path, dataclasses.replace(a, final_prefix="ckpt_"))
        with pytest.raises(RequestError) as changed:
            reloaded_root_check(renamed, {}, a)
        assert changed.value.code is ErrorCode.INVALID_STATE
        reloaded_root_check(config(tmp_path, dataclasses.replace(a, named="/x")), {}, a)


# -- a real daemon -----------------------------------------------------------------------


def toml(*roots: Path, **fields: object) -> str:
    lines = [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    for r in roots:
        lines += ["[[roots]]", f'path = "{r}"']
    return "\n".join(lines) + "\n"


def make_roots(tmp_path: Path, *names: str) -> list[Path]:
    paths = [tmp_path / n for n in names]
    for p in paths:
        p.mkdir()
    return paths


def hup(daemon: DaemonProcess, event: str = "config.reloaded") -> dict[str, Any]:
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGHUP)
    return daemon.wait_event(event, TIMEOUT)


def scrape_metrics(daemon: DaemonProcess) -> tuple[str, Samples]:
    return scrape(daemon.wait_event("metrics.listening", TIMEOUT)["port"])


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply.get("ok") is True, reply
    return reply


def one_rank_save(client: LineClient, root: Path, step: int) -> dict[str, Any]:
    ok(client.request("begin", root=str(root), step=step, rank=0, world_size=1))
    return finish(client, root, step)


def finish(client: LineClient, root: Path, step: int) -> dict[str, Any]:
    f = root / f"tmp_step_{step}" / "weights.bin"
    f.write_bytes(b"w" * 64)
    files = [{"path": "weights.bin", "size": 64}]
    ok(client.request("done", root=str(root), step=step, rank=0, files=files))
    return client.request("wait", root=str(root), step=step, timeout=TIMEOUT)


NOBODY = 65534

_PING = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(15)
s.connect(sys.argv[1])
s.sendall(b'{"op":"ping","id":1}\\n')
print(s.makefile("rb").readline().decode().strip())
"""


def ping_as_nobody(path: Path) -> dict[str, Any]:
    """The first line the daemon answers a ``ping`` from uid/gid nobody with."""
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    result = subprocess.run(
        [python, "-c", _PING, str(path)],
        user=NOBODY,
        group=NOBODY,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=True,
        cwd="/",
    )
    reply: dict[str, Any] = json.loads(result.stdout)
    return reply


@pytest.fixture
def notify_socket(short_dir: Path) -> Iterator[socket.socket]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(short_dir / "notify.sock"))
        sock.settimeout(TIMEOUT)
        yield sock


class TestReload:
    """SIGHUP applies the file's roots and options, or keeps the old ones if it is bad."""

    def test_root_added(self, start: Start, tmp_path: Path) -> None:
        a, b = make_roots(tmp_path, "a", "b")
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml(a))
        daemon = start([], "--config", str(cfg))
        (b / "tmp_step_7").mkdir()  # an orphan: the scan at start-up would report it
        cfg.write_text(toml(a, b))
        reloaded = hup(daemon)
        assert reloaded["added"] == [str(b)] and reloaded["removed"] == []
        orphan = daemon.wait_event("save.orphaned", TIMEOUT, lambda e: e["root"] == str(b))
        assert orphan["step"] == 7 and daemon.seen.index(orphan) < daemon.seen.index(reloaded)
        assert (b / ".ckptd-layout.json").exists()  # written before the event's scan returns
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            assert one_rank_save(client, b, 1)["state"] == "promoted"
            assert str(b) in ok(client.request("status"))["roots"]
        assert (b / "step_1" / "weights.bin").exists()
        assert daemon.stop() == 0

    def test_removed_root_finishes_in_flight_saves(self, start: Start, tmp_path: Path) -> None:
        a, b = make_roots(tmp_path, "a", "b")
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml(a, b))
        daemon = start([], "--config", str(cfg), "--metrics-listen", "127.0.0.1:0")
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            ok(client.request("begin", root=str(b), step=1, rank=0, world_size=1))
            cfg.write_text(toml(a))
            assert hup(daemon)["removed"] == [str(b)]
            _, gauges = scrape_metrics(daemon)
            assert gauges[("ckptd_saves_in_flight", (("root", str(b)),))] == 1  # still counted
            refused = client.request("begin", root=str(b), step=2, rank=0, world_size=1)
            assert refused["error"]["code"] == "root_not_configured"
            assert "removed from the configuration" in refused["error"]["message"]
            assert finish(client, b, 1)["state"] == "promoted"
            daemon.wait_event("root.retired", TIMEOUT, lambda e: e["root"] == str(b))
            gone = client.request("begin", root=str(b), step=3, rank=0, world_size=1)
            assert gone["error"]["code"] == "root_not_configured"
            assert one_rank_save(client, a, 1)["state"] == "promoted"
        assert (b / "step_1" / "weights.bin").exists() and not (b / "tmp_step_2").exists()
        assert daemon.stop() == 0

    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("[[roots]\n", "not valid TOML"),
            ("lease = -1\n", "lease must be > 0"),
            ('[[roots]]\npath = "/nonexistent/run"\n', "is not an existing directory"),
        ],
    )
    def test_bad_file_keeps_the_old_configuration(
        self, start: Start, tmp_path: Path, text: str, expected: str
    ) -> None:
        (a,) = make_roots(tmp_path, "a")
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml(a))
        daemon = start([], "--config", str(cfg))
        cfg.write_text(text + ("" if "[[roots]]" in text else toml(a)))
        failed = hup(daemon, "config.reload_failed")
        assert expected in failed["error"] and failed["level"] == "error"
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            assert one_rank_save(client, a, 1)["state"] == "promoted"
            assert ok(client.request("status"))["roots"] == [str(a)]
        assert daemon.stop() == 0

    def test_log_level_and_restart_fields(self, start: Start, tmp_path: Path) -> None:
        (a,) = make_roots(tmp_path, "a")
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml(a))
        daemon = start([], "--config", str(cfg))
        cfg.write_text(
            toml(a, log_level="warning", stall_timeout=5.0, root_threads=2, node="elsewhere")
        )
        reloaded = hup(daemon)
        assert reloaded["applied"] == ["log_level", "stall_timeout"]
        assert reloaded["restart_required"] == ["node", "root_threads"]
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            client.request("no-such-op")  # request.rejected is a warning: still logged
        daemon.wait_event("request.rejected", TIMEOUT)
        assert daemon.stop() == 0
        after = daemon.seen[daemon.seen.index(reloaded) + 1 :]
        assert "client.connected" not in [e["event"] for e in after]  # info: filtered

    def test_allow_list_applies_to_the_next_connection(
        self, start: Start, tmp_path: Path, short_dir: Path
    ) -> None:
        require_root("connecting as another uid (nobody)")
        (a,) = make_roots(tmp_path, "a")
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml(a, socket_mode=0o666))
        short_dir.chmod(0o755)  # nobody may reach the socket; the daemon decides
        daemon = start([], "--config", str(cfg))
        assert ping_as_nobody(daemon.socket_path)["error"]["code"] == "forbidden"
        cfg.write_text(toml(a, socket_mode=0o666, allowed_uids=[NOBODY]))
        assert hup(daemon)["applied"] == ["allowed_uids"]
        assert ping_as_nobody(daemon.socket_path)["ok"] is True
        cfg.write_text(toml(a, socket_mode=0o666))
        hup(daemon)
        assert ping_as_nobody(daemon.socket_path)["error"]["code"] == "forbidden"
        assert daemon.stop() == 0

    def test_layout_change_waits_for_saves_in_flight(self, start: Start, tmp_path: Path) -> None:
        (a,) = make_roots(tmp_path, "a")
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml(a))
        daemon = start([], "--config", str(cfg))
        renamed = toml(a).replace(f'path = "{a}"', f'path = "{a}"\ntmp_prefix = "wip_"')
        with LineClient(daemon.socket_path, timeout=TIMEOUT) as client:
            ok(client.request("begin", root=str(a), step=1, rank=0, world_size=1))
            cfg.write_text(renamed)
            failed = hup(daemon, "config.reload_failed")
            assert "tmp_prefix cannot change while 1 save(s)" in failed["error"]
            assert finish(client, a, 1)["state"] == "promoted"
            assert hup(daemon)["changed"] == {str(a): ["tmp_prefix"]}
            layout = json.loads((a / ".ckptd-layout.json").read_text())
            assert layout["tmp_prefix"] == "wip_"
            reply = ok(client.request("begin", root=str(a), step=2, rank=0, world_size=1))
            assert reply["path"] == str(a / "wip_2")
        assert daemon.stop() == 0

    def test_tells_systemd(
        self, start: Start, tmp_path: Path, notify_socket: socket.socket
    ) -> None:
        (a,) = make_roots(tmp_path, "a")
        cfg = tmp_path / "c.toml"
        cfg.write_text(toml(a))
        env = {"NOTIFY_SOCKET": notify_socket.getsockname()}
        daemon = start([], "--config", str(cfg), env=env)
        assert b"READY=1" in notify_socket.recv(4096).split(b"\n")
        hup(daemon)
        reloading = notify_socket.recv(4096).split(b"\n")
        assert reloading[0] == b"RELOADING=1" and reloading[1].startswith(b"MONOTONIC_USEC=")
        assert b"READY=1" in notify_socket.recv(4096).split(b"\n")
        cfg.write_text("[[roots]\n")
        hup(daemon, "config.reload_failed")  # a failed reload ends with READY=1 too
        assert notify_socket.recv(4096).startswith(b"RELOADING=1")
        assert b"READY=1" in notify_socket.recv(4096).split(b"\n")
        assert daemon.stop() == 0
