"""The daemon end to end: a real ``ckptd serve`` subprocess, real sockets, real files."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from orchestrator.protocol import MAX_LINE
from tests.conftest import REPO, DaemonProcess, LineClient

TIMEOUT = 15.0
Start = Callable[..., DaemonProcess]
Event = dict[str, Any]
Files = list[dict[str, Any]]


# -- fixtures and helpers ------------------------------------------------------------------


def connect(daemon: DaemonProcess) -> closing[LineClient]:
    return closing(LineClient(daemon.socket_path, timeout=TIMEOUT))


def ok(reply: dict[str, Any]) -> dict[str, Any]:
    assert reply.get("ok") is True, reply
    return reply


def error_code(reply: dict[str, Any]) -> str:
    assert reply.get("ok") is False, reply
    code: str = reply["error"]["code"]
    return code


def of(root: Path, step: int) -> Callable[[Event], bool]:
    """Event filter: the event is about ``step`` of ``root``."""
    return lambda e: e.get("root") == str(root) and e.get("step") == step


def write_files(tmp: Path, rank: int, count: int = 2, size: int = 100) -> Files:
    """Write ``count`` real files for ``rank`` into ``tmp``; return them as ``done`` lists them."""
    entries: Files = []
    for i in range(count):
        rel = f"model/rank{rank}-{i}.bin"
        path = tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes([rank % 256]) * size)
        entries.append({"path": rel, "size": size})
    return entries


def begin(client: LineClient, root: Path, step: int, rank: int, world_size: int) -> dict[str, Any]:
    return client.request("begin", root=str(root), step=step, rank=rank, world_size=world_size)


def done(client: LineClient, root: Path, step: int, rank: int, files: Files) -> dict[str, Any]:
    return client.request("done", root=str(root), step=step, rank=rank, files=files)


def wait(client: LineClient, root: Path, step: int, timeout: float = TIMEOUT) -> dict[str, Any]:
    return client.request("wait", root=str(root), step=step, timeout=timeout)


def save(daemon: DaemonProcess, root: Path, step: int, world_size: int = 2) -> dict[str, Any]:
    """A well-behaved save: every rank on its own connection; returns the ``wait`` reply."""
    clients = [LineClient(daemon.socket_path, timeout=TIMEOUT) for _ in range(world_size)]
    try:
        for rank, client in enumerate(clients):
            ok(begin(client, root, step, rank, world_size))
        tmp = root / f"tmp_step_{step}"
        for rank, client in enumerate(clients):
            ok(done(client, root, step, rank, write_files(tmp, rank)))
        return wait(clients[0], root, step)
    finally:
        for client in clients:
            client.close()


def logged(daemon: DaemonProcess) -> list[Event]:
    """Every event the daemon has logged so far, none still in flight on its stdout.

    A running daemon is sent a marker request that is refused, on a new connection, and
    its ``request.rejected`` is awaited: whatever the daemon logged before answering an
    earlier request is on stdout before it. The marker's own events are left out.
    """
    assert daemon.proc is not None
    if daemon.proc.poll() is not None:
        if not any(e["event"] == "_exit" for e in daemon.drain()):
            daemon.wait_event("_exit", TIMEOUT)
        return [e for e in daemon.drain() if e["event"] != "_exit"]
    token = f"sync-{uuid.uuid4().hex}"
    with connect(daemon) as client:
        assert error_code(client.request(token)) == "unknown_op"
        marker = daemon.wait_event("request.rejected", TIMEOUT, lambda e: token in e["message"])
        conn = marker["conn"]
    return [e for e in daemon.drain() if e.get("conn") != conn]


def names(daemon: DaemonProcess) -> list[str]:
    return [e["event"] for e in logged(daemon)]


def rejections(daemon: DaemonProcess) -> list[tuple[str, int | None]]:
    """``(code, id)`` of every ``request.rejected`` logged so far."""
    return [(e["code"], e["id"]) for e in logged(daemon) if e["event"] == "request.rejected"]


def status_of(client: LineClient, root: Path, step: int) -> dict[str, Any]:
    saves = [s for s in ok(client.request("status"))["saves"] if s["step"] == step]
    assert len(saves) == 1, saves
    result: dict[str, Any] = saves[0]
    return result


def without_taken(event: Event) -> Event:
    return {k: v for k, v in event.items() if k != "_taken"}


def run_cli(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"}
    return subprocess.run(
        [sys.executable, "-m", "daemon", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
        check=False,
    )


def read_line(stream: Any, timeout: float = TIMEOUT) -> bytes:
    """One line from a child's stdout pipe, failing after ``timeout`` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    assert ready, f"no output within {timeout}s"
    line: bytes = stream.readline()
    return line


# A rank process: connects, begins, prints the reply, then blocks until it is killed.
RANK = r"""
import json, socket, sys
path, root, step, rank, world = sys.argv[1:]
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(path)
request = {"op": "begin", "id": 1, "root": root, "step": int(step), "rank": int(rank),
           "world_size": int(world)}
sock.sendall(json.dumps(request).encode() + b"\n")
print(sock.makefile("rb").readline().decode().strip(), flush=True)
sys.stdin.read()
"""


# -- promotion ------------------------------------------------------------------------------


class TestPromotion:
    """A step is renamed into place only once every rank is done and its files check out."""

    def test_two_ranks_promote(self, start: Start, root: Path) -> None:
        daemon = start([root])
        step = 3
        tmp, final = root / f"tmp_step_{step}", root / f"step_{step}"
        with connect(daemon) as r0, connect(daemon) as r1:
            reply = ok(begin(r0, root, step, 0, 2))
            assert reply["path"] == str(tmp)
            assert reply["state"] == "open"
            ok(begin(r1, root, step, 1, 2))
            files0 = write_files(tmp, 0, count=3)
            files1 = write_files(tmp, 1, count=2, size=300)
            (tmp / "config.json").write_text('{"lr": 1}')
            files1.append({"path": "config.json", "size": 9})
            ok(done(r0, root, step, 0, files0))

            # The daemon promotes only on the last done: rank 1 is still writing.
            info = status_of(r0, root, step)
            assert info["state"] == "open"
            assert {r["rank"]: r["state"] for r in info["ranks"]} == {0: "done", 1: "writing"}
            assert not final.exists()
            assert tmp.is_dir()

            ok(done(r1, root, step, 1, files1))
            reply = ok(wait(r0, root, step))
        assert reply["state"] == "promoted"
        assert reply["path"] == str(final)
        assert final.is_dir()
        assert not tmp.exists()
        assert os.readlink(root / "latest") == f"step_{step}"
        assert (root / "latest").resolve() == final.resolve()
        manifest = json.loads((final / ".ckptd-manifest.json").read_bytes())
        assert manifest["step"] == step
        assert manifest["files"]["model/rank1-0.bin"] == 300
        assert manifest["files"]["config.json"] == 9
        assert (final / "model" / "rank0-2.bin").read_bytes() == b"\0" * 100

        event = daemon.wait_event("checkpoint.promoted", TIMEOUT, of(root, step))
        assert event["path"] == str(final)
        assert event["bytes"] == 3 * 100 + 2 * 300 + 9
        assert event["files"] == 6
        assert event["duration_s"] >= 0
        assert event["promotion_ms"] >= 0
        assert event["latest"] is True
        assert names(daemon).count("checkpoint.promoted") == 1

    def test_latest_only_moves_forward(self, start: Start, root: Path) -> None:
        daemon = start([root])
        assert ok(save(daemon, root, 2))["state"] == "promoted"
        assert ok(save(daemon, root, 1))["state"] == "promoted"
        assert os.readlink(root / "latest") == "step_2"
        older = daemon.wait_event("checkpoint.promoted", TIMEOUT, of(root, 1))
        assert older["latest"] is False
        with connect(daemon) as client:
            reply = ok(client.request("latest", root=str(root)))
        assert (reply["step"], reply["path"]) == (2, str(root / "step_2"))
        assert (root / "step_1").is_dir()

    def test_a_rank_may_write_nothing(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as r0, connect(daemon) as r1:
            ok(begin(r0, root, 5, 0, 2))
            ok(begin(r1, root, 5, 1, 2))
            ok(done(r0, root, 5, 0, write_files(root / "tmp_step_5", 0)))
            ok(done(r1, root, 5, 1, []))
            assert ok(wait(r1, root, 5))["state"] == "promoted"
        assert (root / "step_5" / "model" / "rank0-1.bin").is_file()

    def test_pointer_failure_keeps_the_promotion(self, start: Start, root: Path) -> None:
        # The rename is the commit point: a pointer that cannot be written after it is
        # reported, but the durable checkpoint is not reported as failed.
        (root / "latest").mkdir()  # a directory where the pointer symlink must go
        daemon = start([root])
        with connect(daemon) as client:
            ok(begin(client, root, 4, 0, 1))
            ok(done(client, root, 4, 0, write_files(root / "tmp_step_4", 0)))
            reply = ok(wait(client, root, 4))
        assert (reply["state"], reply["path"]) == ("promoted", str(root / "step_4"))
        assert (root / "step_4" / ".ckptd-manifest.json").is_file()
        assert not (root / "tmp_step_4").exists()
        problem = daemon.wait_event("pointer.failed", TIMEOUT, of(root, 4))
        assert "latest not moved" in problem["reason"]
        promoted = daemon.wait_event("checkpoint.promoted", TIMEOUT, of(root, 4))
        assert promoted["latest"] is False
        assert "checkpoint.failed" not in names(daemon)
        assert (root / "latest").is_dir() and not (root / "latest").is_symlink()


def _missing(tmp: Path) -> Files:
    files = write_files(tmp, 0)
    (tmp / files[1]["path"]).unlink()
    return files


def _short(tmp: Path) -> Files:
    files = write_files(tmp, 0)
    with open(tmp / files[0]["path"], "r+b") as fh:
        fh.truncate(10)
    return files


def _dcp_without_metadata(tmp: Path) -> Files:
    (tmp / "optim").mkdir(parents=True)
    (tmp / "optim" / "__0_0.distcp").write_bytes(b"\1" * 64)
    return [{"path": "optim/__0_0.distcp", "size": 64}]


def _symlink_out(tmp: Path) -> Files:
    files = write_files(tmp, 0)
    (tmp / "model" / "passwd").symlink_to("/etc/passwd")
    return files


def _dir_symlink_out(tmp: Path) -> Files:
    files = write_files(tmp, 0)
    outside = tmp.parent.parent / "elsewhere"
    outside.mkdir()
    (tmp / "sneaky").symlink_to(outside, target_is_directory=True)
    return files


def _fifo(tmp: Path) -> Files:
    files = write_files(tmp, 0)
    os.mkfifo(tmp / "model" / "pipe")
    return files


def _tmp_swapped_for_symlink(tmp: Path) -> Files:
    # Begun as a plain directory; a rank then makes it a symlink elsewhere.
    elsewhere = tmp.parent.parent / "elsewhere"
    files = write_files(elsewhere, 0)
    os.rename(tmp, tmp.parent.parent / "begun")
    tmp.symlink_to(elsewhere, target_is_directory=True)
    return files


def _final_appeared(tmp: Path) -> Files:
    # Someone else created step_N after begin: the rename must not replace it.
    files = write_files(tmp, 0)
    (tmp.parent / "step_4").mkdir()
    (tmp.parent / "step_4" / "theirs").write_bytes(b"keep me")
    return files


class TestVerificationFailure:
    """A save whose files do not prove it complete fails with a reason; files are kept."""

    @pytest.mark.parametrize(
        ("setup", "reason"),
        [
            (_missing, "model/rank0-1.bin: reported by rank 0 but missing"),
            (_short, "model/rank0-0.bin: 10 bytes on disk, rank 0 reported 100"),
            (_dcp_without_metadata, "optim/.metadata: missing"),
            (_symlink_out, "model/passwd: symlink to '/etc/passwd' leaves the save"),
            (_dir_symlink_out, "sneaky: symlink to"),
            (_fifo, "model/pipe: not a regular file or directory"),
            (_tmp_swapped_for_symlink, "is a symlink; refusing to promote through it"),
            (_final_appeared, "rename failed for"),
        ],
        ids=[
            "missing",
            "short",
            "distcp-without-metadata",
            "symlink-to-etc-passwd",
            "dir-symlink-out",
            "fifo",
            "tmp-dir-becomes-symlink",
            "final-dir-appeared",
        ],
    )
    def test_refused(
        self, start: Start, root: Path, setup: Callable[[Path], Files], reason: str
    ) -> None:
        daemon = start([root])
        step = 4
        tmp = root / f"tmp_step_{step}"
        with connect(daemon) as client:
            ok(begin(client, root, step, 0, 1))
            files = setup(tmp)
            ok(done(client, root, step, 0, files))
            reply = ok(wait(client, root, step))
            assert reply["state"] == "failed"
            assert reason in reply["reason"]
            assert status_of(client, root, step)["state"] == "failed"
        event = daemon.wait_event("checkpoint.failed", TIMEOUT, of(root, step))
        assert reason in event["reason"]
        assert "checkpoint.promoted" not in names(daemon)
        assert not (root / "latest").exists()
        if setup is _tmp_swapped_for_symlink:
            assert tmp.is_symlink()  # the daemon never moves what a symlink points to
            return
        # The failed attempt's files are kept for inspection, set aside in the trash.
        kept = Path(daemon.wait_event("save.set_aside", TIMEOUT, of(root, step))["path"])
        assert kept.parent == root / ".ckptd-trash" and kept.name.startswith("tmp_step_4.attempt")
        assert not os.path.lexists(tmp)
        if setup is _final_appeared:
            assert (root / "step_4" / "theirs").read_bytes() == b"keep me"
            assert (kept / "model" / "rank0-0.bin").is_file()
        else:
            assert not (root / f"step_{step}").exists()

    def test_tmp_dir_symlink_refused_at_begin(self, start: Start, root: Path) -> None:
        daemon = start([root])
        elsewhere = root.parent / "elsewhere"
        elsewhere.mkdir()
        (root / "tmp_step_6").symlink_to(elsewhere, target_is_directory=True)
        with connect(daemon) as client:
            assert error_code(begin(client, root, 6, 0, 1)) == "path_escape"
            assert ok(client.request("status"))["saves"] == []
        assert not (root / "step_6").exists()
        assert (root / "tmp_step_6").is_symlink()


# -- bad input --------------------------------------------------------------------------------


HUGE_STEP = b'{"op": "begin", "id": 3, "root": "/r", "step": 1e400, "rank": 0, "world_size": 1}\n'
BadCase = Callable[[LineClient, Path], dict[str, Any]]


def _raw(data: bytes) -> BadCase:
    def send(client: LineClient, _root: Path) -> dict[str, Any]:
        client.send_raw(data)
        return client.recv()

    return send


def _world_size_changes(client: LineClient, root: Path) -> dict[str, Any]:
    ok(begin(client, root, 9, 0, 2))
    return begin(client, root, 9, 1, 3)


def _file_with_dotdot(client: LineClient, root: Path) -> dict[str, Any]:
    ok(begin(client, root, 11, 0, 1))
    return done(client, root, 11, 0, [{"path": "model/../../x", "size": 1}])


def _absolute_file(client: LineClient, root: Path) -> dict[str, Any]:
    ok(begin(client, root, 11, 0, 1))
    return done(client, root, 11, 0, [{"path": "/etc/passwd", "size": 1}])


def _begin_promoted(client: LineClient, root: Path) -> dict[str, Any]:
    ok(begin(client, root, 12, 0, 1))
    ok(done(client, root, 12, 0, write_files(root / "tmp_step_12", 0)))
    assert ok(wait(client, root, 12))["state"] == "promoted"
    return begin(client, root, 12, 0, 1)


def _begin_existing_on_disk(client: LineClient, root: Path) -> dict[str, Any]:
    (root / "step_13").mkdir()
    return begin(client, root, 13, 0, 1)


def _fail_after_done(client: LineClient, root: Path) -> dict[str, Any]:
    ok(begin(client, root, 15, 0, 2))
    ok(done(client, root, 15, 0, []))
    return client.request("fail", root=str(root), step=15, rank=0, reason="too late")


def _tmp_dir_is_a_file(client: LineClient, root: Path) -> dict[str, Any]:
    (root / "tmp_step_16").write_text("not a directory")
    return begin(client, root, 16, 0, 1)


def _subscribe_twice(client: LineClient, root: Path) -> dict[str, Any]:
    ok(client.request("subscribe"))
    return client.request("subscribe")


def _file_with_nul(client: LineClient, root: Path) -> dict[str, Any]:
    ok(begin(client, root, 17, 0, 1))
    return done(client, root, 17, 0, [{"path": "model/a\0b", "size": 1}])


BAD_INPUT: dict[str, tuple[BadCase, str]] = {
    "not-json": (_raw(b"{not json\n"), "bad_json"),
    "invalid-utf8": (_raw(b"\xff\xfe\xfd\n"), "bad_json"),
    "invalid-utf8-in-field": (
        _raw(b'{"op": "latest", "id": 3, "root": "/r\xff"}\n'),
        "bad_json",
    ),
    "json-array": (_raw(b'[{"op": "ping", "id": 1}]\n'), "bad_request"),
    "json-string": (_raw(b'"ping"\n'), "bad_request"),
    "no-id": (_raw(b'{"op": "ping"}\n'), "bad_request"),
    "unknown-op": (lambda c, r: c.request("explode"), "unknown_op"),
    "missing-field": (
        lambda c, r: c.request("begin", root=str(r), step=1, rank=0),
        "invalid_field",
    ),
    "mistyped-field": (
        lambda c, r: c.request("begin", root=str(r), step="one", rank=0, world_size=2),
        "invalid_field",
    ),
    "negative-step": (
        lambda c, r: c.request("begin", root=str(r), step=-1, rank=0, world_size=2),
        "invalid_field",
    ),
    "rank-out-of-range": (lambda c, r: begin(c, r, 8, 2, 2), "rank_out_of_range"),
    "world-size-mismatch": (_world_size_changes, "world_size_mismatch"),
    "root-not-configured": (
        lambda c, r: begin(c, r.parent / "other", 1, 0, 1),
        "root_not_configured",
    ),
    "relative-root": (
        lambda c, r: c.request("begin", root="run", step=1, rank=0, world_size=1),
        "path_escape",
    ),
    "dotdot-root": (
        lambda c, r: c.request("begin", root=f"{r}/../{r.name}", step=1, rank=0, world_size=1),
        "path_escape",
    ),
    "file-with-dotdot": (_file_with_dotdot, "path_escape"),
    "absolute-file": (_absolute_file, "path_escape"),
    "begin-promoted-step": (_begin_promoted, "already_promoted"),
    "begin-step-on-disk": (_begin_existing_on_disk, "already_promoted"),
    "done-before-begin": (lambda c, r: done(c, r, 14, 0, []), "not_begun"),
    "fail-before-begin": (
        lambda c, r: c.request("fail", root=str(r), step=14, rank=0, reason="x"),
        "not_begun",
    ),
    "fail-after-done": (_fail_after_done, "invalid_state"),
    "tmp-dir-is-a-file": (_tmp_dir_is_a_file, "invalid_state"),
    "subscribe-twice": (_subscribe_twice, "invalid_state"),
    "file-with-nul": (_file_with_nul, "path_escape"),
    "line-too-long": (_raw(b"x" * (MAX_LINE + 10) + b"\n"), "line_too_long"),
    "latest-none": (lambda c, r: c.request("latest", root=str(r)), "not_found"),
    "wait-unknown-root": (
        lambda c, r: c.request("wait", root=str(r.parent / "other"), step=1, timeout=5),
        "root_not_configured",
    ),
    "wait-relative-root": (
        lambda c, r: c.request("wait", root="run", step=1, timeout=5),
        "path_escape",
    ),
}


class TestBadInput:
    """Each bad request gets its own error code; the connection and other saves live on."""

    @pytest.mark.parametrize("case", list(BAD_INPUT))
    def test_rejected(self, start: Start, root: Path, case: str) -> None:
        send, code = BAD_INPUT[case]
        daemon = start([root])
        step = 100
        tmp = root / f"tmp_step_{step}"
        with connect(daemon) as bad, connect(daemon) as r0, connect(daemon) as r1:
            # A well-behaved save is in flight around the bad request.
            ok(begin(r0, root, step, 0, 2))
            reply = send(bad, root)
            assert error_code(reply) == code, reply
            assert reply["error"]["message"]
            assert rejections(daemon) == [(code, reply["id"])]

            assert ok(bad.request("ping"))["protocol"] == 1  # same connection still served
            ok(begin(r1, root, step, 1, 2))
            ok(done(r0, root, step, 0, write_files(tmp, 0)))
            ok(done(r1, root, step, 1, write_files(tmp, 1)))
            assert ok(wait(bad, root, step))["state"] == "promoted"
        assert (root / f"step_{step}").is_dir()
        assert "daemon.internal_error" not in names(daemon)
        assert daemon.proc is not None and daemon.proc.poll() is None

    def test_line_of_exactly_max_line_is_accepted(self, start: Start, root: Path) -> None:
        daemon = start([root])
        request = b'{"op": "ping", "id": 7}'
        with connect(daemon) as client:
            client.send_raw(request + b" " * (MAX_LINE - len(request) - 1) + b"\n")
            assert ok(client.recv())["id"] == 7
            client.send_raw(request + b" " * (MAX_LINE - len(request)) + b"\n")
            assert error_code(client.recv()) == "line_too_long"
            assert ok(client.request("ping"))["id"] == 1

    def test_many_bad_lines_in_one_write(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            client.send_raw(b'nope\n[]\n{"op": "x", "id": 4}\n{"op": "ping", "id": 5}\n')
            replies = [client.recv() for _ in range(4)]
        codes = [r["error"]["code"] if not r["ok"] else "ok" for r in replies]
        assert codes == ["bad_json", "bad_request", "unknown_op", "ok"]
        assert [r["id"] for r in replies] == [None, None, 4, 5]

    @pytest.mark.parametrize(
        ("line", "code"),
        [
            (b'{"op": "ping", "id": 1e400}\n', "bad_request"),
            (b"[1e400]\n", "bad_request"),
            (HUGE_STEP, "invalid_field"),
        ],
        ids=["id", "array", "step"],
    )
    def test_out_of_range_float(self, start: Start, root: Path, line: bytes, code: str) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            client.send_raw(line)
            reply = client.recv()
            assert ok(client.request("ping"))["protocol"] == 1
        assert error_code(reply) == code
        assert "daemon.internal_error" not in names(daemon)

    @pytest.mark.parametrize(
        "line",
        [
            b"[" * 5000 + b"]" * 5000 + b"\n",
            b'{"op": "ping", "id": 1, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}\n",
        ],
        ids=["array", "in-unknown-field"],
    )
    def test_deeply_nested_json(self, start: Start, root: Path, line: bytes) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            client.send_raw(line)
            reply = client.recv()
            assert ok(client.request("ping"))["protocol"] == 1
        assert "daemon.internal_error" not in names(daemon)
        assert error_code(reply) in ("bad_json", "bad_request"), reply

    def test_invalid_utf8_in_unknown_field(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            client.send_raw(b'{"op": "ping", "id": 1, "note": "\xff\xfe"}\n')
            reply = client.recv()
        assert error_code(reply) == "bad_json"


# -- rank death, fail, wait ---------------------------------------------------------------------


class TestRankDeath:
    """A rank whose connection drops must come back within its lease or the step fails."""

    def test_killed_rank_fails_the_step(self, start: Start, root: Path) -> None:
        daemon = start([root], "--lease", "0.5")
        step = 21
        tmp = root / f"tmp_step_{step}"
        with (
            connect(daemon) as r1,
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    RANK,
                    str(daemon.socket_path),
                    str(root),
                    str(step),
                    "0",
                    "2",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            ) as rank0,
        ):
            assert rank0.stdout is not None
            assert json.loads(read_line(rank0.stdout))["ok"] is True
            ok(begin(r1, root, step, 1, 2))
            files = write_files(tmp, 1)
            rank0.send_signal(signal.SIGKILL)
            assert rank0.wait(TIMEOUT) == -signal.SIGKILL

            dropped = daemon.wait_event("save.rank_disconnected", TIMEOUT, of(root, step))
            assert dropped["rank"] == 0
            failed = daemon.wait_event("checkpoint.failed", TIMEOUT, of(root, step))
            assert "lease" in failed["reason"]
            assert "rank 0" in failed["reason"]

            # The surviving rank finishes afterwards: too late, never promoted.
            assert error_code(done(r1, root, step, 1, files)) == "step_failed"
            reply = ok(wait(r1, root, step))
            assert reply["state"] == "failed"
            assert "lease" in reply["reason"]
        assert not (root / f"step_{step}").exists()
        kept = Path(daemon.wait_event("save.set_aside", TIMEOUT, of(root, step))["path"])
        assert (kept / "model" / "rank1-0.bin").is_file()
        assert "checkpoint.promoted" not in names(daemon)

    def test_closed_connection_after_done_is_harmless(self, start: Start, root: Path) -> None:
        daemon = start([root], "--lease", "0.5")
        with connect(daemon) as r0:
            ok(begin(r0, root, 22, 0, 2))
            ok(done(r0, root, 22, 0, []))
        with connect(daemon) as r1:
            ok(begin(r1, root, 22, 1, 2))
            ok(done(r1, root, 22, 1, write_files(root / "tmp_step_22", 1)))
            assert ok(wait(r1, root, 22))["state"] == "promoted"
        assert "save.rank_disconnected" not in names(daemon)

    def test_rank_reconnects_within_lease(self, start: Start, root: Path) -> None:
        daemon = start([root], "--lease", "30")
        step = 23
        tmp = root / f"tmp_step_{step}"
        with connect(daemon) as r1:
            with connect(daemon) as first:
                ok(begin(first, root, step, 0, 2))
            dropped = daemon.wait_event("save.rank_disconnected", TIMEOUT, of(root, step))
            assert (dropped["rank"], dropped["lease_s"]) == (0, 30.0)
            info = status_of(r1, root, step)
            assert info["ranks"][0]["connected"] is False
            assert 0 < info["ranks"][0]["lease_s"] <= 30

            with connect(daemon) as again:
                reply = ok(begin(again, root, step, 0, 2))
                assert reply["state"] == "open"
                daemon.wait_event("save.rank_reconnected", TIMEOUT, of(root, step))
                ok(begin(r1, root, step, 1, 2))
                ok(done(again, root, step, 0, write_files(tmp, 0)))
                ok(done(r1, root, step, 1, write_files(tmp, 1)))
                assert ok(wait(again, root, step))["state"] == "promoted"
        assert (root / f"step_{step}").is_dir()


class TestFail:
    """A rank's ``fail`` fails the step for good, with its reason."""

    def test_fail(self, start: Start, root: Path) -> None:
        daemon = start([root])
        step = 31
        with connect(daemon) as r0, connect(daemon) as r1:
            begin_reply = ok(begin(r0, root, step, 0, 2))
            ok(begin(r1, root, step, 1, 2))
            files = write_files(root / f"tmp_step_{step}", 0)
            ok(r1.request("fail", root=str(root), step=step, rank=1, reason="ENOSPC on upload"))
            event = daemon.wait_event("checkpoint.failed", TIMEOUT, of(root, step))
            assert "ENOSPC on upload" in event["reason"]
            reply = ok(wait(r0, root, step))
            assert reply["state"] == "failed"
            assert "ENOSPC on upload" in reply["reason"]
            assert error_code(done(r0, root, step, 0, files)) == "step_failed"
            assert error_code(begin(r0, root, step, 0, 2)) == "step_failed"
            info = status_of(r0, root, step)
            assert info["state"] == "failed"
            assert info["ranks"][1]["state"] == "failed"
        assert not (root / f"step_{step}").exists()
        # Set aside before the failure was reported: the reply above already saw it moved.
        assert not (root / f"tmp_step_{step}").exists()
        assert (Path(info["set_aside"]) / "model" / "rank0-0.bin").is_file()
        assert info["attempt"] == ok(begin_reply)["attempt"]


class TestWait:
    """``wait`` answers when the step settles, or ``pending`` at its timeout."""

    def test_waits_on_steps_that_never_begin_leave_nothing(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            for step in range(1000, 1250):
                request = {"op": "wait", "id": step, "root": str(root), "step": step}
                client.send_raw(json.dumps({**request, "timeout": 0.05}).encode() + b"\n")
            replies = [client.recv() for _ in range(250)]
            assert {r["state"] for r in replies} == {"pending"}
            status = ok(client.request("status"))
        assert (status["waits"], status["waited_steps"]) == (0, 0)

    def test_timeout_on_pending_step(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client:
            ok(begin(client, root, 41, 0, 2))
            assert ok(wait(client, root, 41, timeout=0.2))["state"] == "pending"
            assert ok(wait(client, root, 999, timeout=0.1))["state"] == "pending"
            assert ok(client.request("wait", root=str(root), step=41))["state"] == "pending"

    def test_wait_before_begin(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as waiter:
            waiter.send_raw(
                json.dumps(
                    {"op": "wait", "id": 77, "root": str(root), "step": 42, "timeout": 30}
                ).encode()
                + b"\n"
            )
            # The wait does not block the connection: later requests are answered first.
            assert ok(waiter.request("ping"))["id"] == 1
            assert ok(save(daemon, root, 42))["state"] == "promoted"
            reply = waiter.recv()
        assert reply == {
            "id": 77,
            "ok": True,
            "state": "promoted",
            "path": str(root / "step_42"),
            "reason": None,
            "attempt": reply["attempt"],
        }
        assert reply["attempt"]  # the attempt that was promoted

    def test_wait_for_step_promoted_before_the_daemon_started(
        self, start: Start, root: Path
    ) -> None:
        first = start([root], socket_name="first.sock")
        assert ok(save(first, root, 43))["state"] == "promoted"
        assert first.stop() == 0
        # Its own state directory, empty: only the root says step 43 was promoted.
        daemon = start([root])
        with connect(daemon) as client:
            reply = ok(wait(client, root, 43))
        assert (reply["state"], reply["path"]) == ("promoted", str(root / "step_43"))

    def test_a_step_dir_the_daemon_did_not_promote_is_not_promoted(
        self, start: Start, root: Path
    ) -> None:
        (root / "step_43").mkdir()  # made by hand: no manifest
        (root / "step_43" / "weights.bin").write_bytes(b"x")
        (root / "step_44").mkdir()  # a manifest of another step (a copy renamed)
        (root / "step_44" / ".ckptd-manifest.json").write_text(
            json.dumps({"root": str(root), "step": 4, "created": ""})
        )
        daemon = start([root])
        with connect(daemon) as client:
            for step in (43, 44):
                reply = ok(wait(client, root, step, timeout=0.2))
                assert reply["state"] == "pending", (step, reply)


class TestSubscribe:
    """A subscribed connection receives the very event objects the daemon logs."""

    def test_same_events_as_stdout(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as sub:
            assert ok(sub.request("subscribe")) == {"id": 1, "ok": True}
            assert ok(save(daemon, root, 51))["state"] == "promoted"
            streamed: list[Event] = []
            while not streamed or streamed[-1]["event"] != "checkpoint.promoted":
                streamed.append(sub.recv())
            # Requests still work on a subscribed connection.
            assert ok(sub.request("ping"))["id"] == 2
        promoted = without_taken(daemon.wait_event("checkpoint.promoted", TIMEOUT, of(root, 51)))
        assert streamed[-1] == promoted
        assert set(promoted) >= {"root", "step", "path", "bytes", "files", "duration_s"}
        on_stdout = [
            without_taken(e)
            for e in logged(daemon)
            if e["event"] in ("save.begun", "save.rank_done")
        ]
        assert [e for e in streamed if e["event"] in ("save.begun", "save.rank_done")] == on_stdout


class TestStatus:
    """``status`` lists every save with its ranks, optionally for one root."""

    def test_per_rank_state_and_root_filter(self, start: Start, root: Path, tmp_path: Path) -> None:
        other = tmp_path / "other"
        other.mkdir()
        daemon = start([root, other])
        with connect(daemon) as r0, connect(daemon) as r1, connect(daemon) as r2:
            ok(begin(r0, root, 61, 0, 3))
            ok(begin(r1, root, 61, 1, 3))
            ok(done(r0, root, 61, 0, write_files(root / "tmp_step_61", 0, count=2, size=50)))
            ok(begin(r2, other, 7, 0, 1))

            reply = ok(r0.request("status"))
            assert reply["roots"] == [str(root), str(other)]
            assert daemon.proc is not None
            assert reply["pid"] == daemon.proc.pid
            found = sorted((s["root"], s["step"]) for s in reply["saves"])
            assert found == sorted([(str(root), 61), (str(other), 7)])
            info = status_of(r0, root, 61)
            assert info["world_size"] == 3
            assert info["state"] == "open"
            assert info["ranks"] == [
                {"rank": 0, "state": "done", "connected": True, "files": 2, "bytes": 100},
                {"rank": 1, "state": "writing", "connected": True},
            ]

            only = ok(r0.request("status", root=str(other)))["saves"]
            assert [(s["root"], s["step"], s["state"]) for s in only] == [(str(other), 7, "open")]
            bad = r0.request("status", root=str(tmp_path / "nope"))
            assert error_code(bad) == "root_not_configured"


class TestGc:
    """``gc`` takes set-aside attempts and stale orphans, never active saves or checkpoints."""

    def test_gc(self, start: Start, root: Path) -> None:
        daemon = start([root])
        assert ok(save(daemon, root, 1))["state"] == "promoted"
        promoted_files = sorted(p.name for p in (root / "step_1" / "model").iterdir())
        old = 1_000_000_000.0  # 2001: far older than any save timeout

        with connect(daemon) as client, connect(daemon) as active:
            ok(begin(client, root, 2, 0, 2))
            write_files(root / "tmp_step_2", 0)
            ok(client.request("fail", root=str(root), step=2, rank=0, reason="boom"))
            daemon.wait_event("checkpoint.failed", TIMEOUT, of(root, 2))
            kept = daemon.wait_event("save.set_aside", TIMEOUT, of(root, 2))["path"]

            write_files(root / "tmp_step_3", 0)  # orphan: the daemon never heard of it
            set_mtime(root / "tmp_step_3", old)
            write_files(root / "tmp_step_5", 0)  # fresh orphan: a trainer may be writing it

            ok(begin(active, root, 4, 0, 2))
            step4 = write_files(root / "tmp_step_4", 0)
            set_mtime(root / "tmp_step_4", old)

            # Failed step 2 is its set-aside directory: tmp_step_2 no longer exists.
            listed = ok(client.request("gc", root=str(root)))
            assert listed["candidates"] == [str(root / "tmp_step_3")]
            assert (listed["set_aside"], listed["absent"]) == ([kept], [])
            assert listed["removed"] is False
            assert Path(kept).is_dir() and (root / "tmp_step_3").is_dir()

            removed = ok(client.request("gc", root=str(root), remove=True))
            assert removed == {**listed, "id": removed["id"], "removed": True}
            event = daemon.wait_event("gc.removed", TIMEOUT)
            assert (event["steps"], event["set_aside"], event["forgotten"]) == (
                [3],
                [Path(kept).name],
                [2],
            )
            assert not Path(kept).exists()
            assert not (root / "tmp_step_3").exists()
            deleted = {daemon.wait_event("trash.deleted", TIMEOUT)["entry"] for _ in range(2)}
            assert {name.split(".")[0] for name in deleted} == {"tmp_step_2", "tmp_step_3"}
            assert list((root / ".ckptd-trash").iterdir()) == [root / ".ckptd-trash" / "delete"]
            assert list((root / ".ckptd-trash" / "delete").iterdir()) == []
            assert (root / "tmp_step_4" / "model" / "rank0-0.bin").is_file()
            assert (root / "tmp_step_5").is_dir()
            assert sorted(p.name for p in (root / "step_1" / "model").iterdir()) == promoted_files
            assert os.readlink(root / "latest") == "step_1"
            assert [s["step"] for s in ok(client.request("status"))["saves"]] == [1, 4]

            again = ok(client.request("gc", root=str(root), remove=True))
            assert again == {
                "id": again["id"],
                "ok": True,
                "candidates": [],
                "removed": False,
                "set_aside": [],
                "absent": [],
            }
            # The active save still promotes after gc.
            ok(begin(client, root, 4, 1, 2))
            ok(done(active, root, 4, 0, step4))
            ok(done(client, root, 4, 1, []))
            assert ok(wait(client, root, 4))["state"] == "promoted"


def set_mtime(path: Path, when: float) -> None:
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for name in (*filenames, *dirnames):
            os.utime(os.path.join(dirpath, name), (when, when), follow_symlinks=False)
        os.utime(dirpath, (when, when))


# -- lifecycle ----------------------------------------------------------------------------------


class TestLifecycle:
    """Socket ownership, signals, configuration and exit codes of ``ckptd serve``."""

    def test_socket_mode(self, start: Start, root: Path) -> None:
        daemon = start([root])
        mode = os.stat(daemon.socket_path).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o660

    def test_sigterm_stops_cleanly(self, start: Start, root: Path) -> None:
        daemon = start([root])
        with connect(daemon) as client, connect(daemon) as waiter:
            ok(begin(client, root, 1, 0, 2))  # an open save and a pending wait do not hold it
            request = {"op": "wait", "id": 9, "root": str(root), "step": 1, "timeout": 600}
            waiter.send_raw(json.dumps(request).encode() + b"\n")
            assert ok(waiter.request("ping"))["id"] == 1
            assert daemon.stop(signal.SIGTERM, TIMEOUT) == 0
            assert waiter.file.readline() == b"", "the connection is closed on stop"
        daemon.wait_event("daemon.stopped", TIMEOUT)
        assert not os.path.lexists(daemon.socket_path)
        order = names(daemon)
        assert order.index("daemon.signal") < order.index("daemon.stopped")

    def test_stale_socket_is_replaced(self, start: Start, root: Path, short_dir: Path) -> None:
        path = short_dir / "d.sock"
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(path))
        stale.close()
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        daemon = start([root])
        with connect(daemon) as client:
            assert ok(client.request("ping"))["protocol"] == 1

    def test_second_daemon_on_live_socket(self, start: Start, root: Path) -> None:
        daemon = start([root])
        before = os.stat(daemon.socket_path)
        second = run_cli("serve", "--socket", str(daemon.socket_path), "--root", str(root))
        assert second.returncode == 2
        assert f"another daemon is listening on {daemon.socket_path}" in second.stderr
        assert os.path.samestat(os.stat(daemon.socket_path), before)
        with connect(daemon) as client:
            assert ok(client.request("ping"))["protocol"] == 1

    def test_socket_path_that_is_not_a_socket(self, short_dir: Path, root: Path) -> None:
        path = short_dir / "d.sock"
        path.write_text("precious")
        result = run_cli("serve", "--socket", str(path), "--root", str(root))
        assert result.returncode == 2
        assert "is not a socket" in result.stderr
        assert path.read_text() == "precious"

    def test_missing_root(self, short_dir: Path, tmp_path: Path) -> None:
        missing = tmp_path / "absent"
        result = run_cli("serve", "--socket", str(short_dir / "d.sock"), "--root", str(missing))
        assert result.returncode == 2
        assert f"root {missing} is not an existing directory" in result.stderr
        assert not (short_dir / "d.sock").exists()

    def test_config_file(self, start: Start, root: Path, tmp_path: Path) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(
            f'lease = 12.5\n[[roots]]\npath = "{root}"\ntmp_prefix = "incoming-"\n'
            'final_prefix = "ckpt-"\npointer = "current"\n'
        )
        daemon = start([], "--config", str(config))
        step = 8
        with connect(daemon) as client:
            reply = ok(begin(client, root, step, 0, 1))
            assert reply["path"] == str(root / "incoming-8")
            ok(done(client, root, step, 0, write_files(root / "incoming-8", 0)))
            assert ok(wait(client, root, step))["path"] == str(root / "ckpt-8")
            assert ok(client.request("latest", root=str(root)))["path"] == str(root / "ckpt-8")
            assert ok(client.request("status"))["roots"] == [str(root)]
            # The lease from the file applies.
            with connect(daemon) as dropped:
                ok(begin(dropped, root, 9, 0, 1))
            event = daemon.wait_event("save.rank_disconnected", TIMEOUT, of(root, 9))
            assert event["lease_s"] == 12.5
        assert os.readlink(root / "current") == "ckpt-8"
        assert not (root / "latest").exists()
        assert (root / "ckpt-8" / ".ckptd-manifest.json").is_file()

    @pytest.mark.parametrize("loop", ["", "uvloop", "asyncio"])
    def test_event_loop(self, start: Start, root: Path, tmp_path: Path, loop: str) -> None:
        config = tmp_path / "ckptd.toml"
        setting = f'event_loop = "{loop}"\n' if loop else ""
        config.write_text(f'{setting}[[roots]]\npath = "{root}"\n')
        daemon = start([], "--config", str(config))
        ready = next(e for e in daemon.seen if e["event"] == "daemon.ready")
        assert ready["event_loop"] == (loop or "uvloop")  # uvloop is a dependency
        with connect(daemon) as client:
            ok(begin(client, root, 1, 0, 1))
            ok(done(client, root, 1, 0, write_files(root / "tmp_step_1", 0)))
            assert ok(wait(client, root, 1))["state"] == "promoted"

    def test_unknown_event_loop(self, short_dir: Path, root: Path, tmp_path: Path) -> None:
        config = tmp_path / "ckptd.toml"
        config.write_text(f'event_loop = "trio"\n[[roots]]\npath = "{root}"\n')
        result = run_cli("serve", "--socket", str(short_dir / "d.sock"), "--config", str(config))
        assert result.returncode == 2
        assert "event_loop must be uvloop or asyncio, got 'trio'" in result.stderr

    def test_shutdown_lets_promotion_finish(self, start: Start, root: Path) -> None:
        # Promotion fsyncs every file: 500 of them take ~2 s on this machine's disk (a few
        # ms each), so SIGTERM, sent a few ms after checkpoint.promoting, lands while the
        # promotion runs; the order of daemon.signal below checks that it did.
        daemon = start([root])
        step = 71
        tmp = root / f"tmp_step_{step}"
        count = 500
        with connect(daemon) as client:
            ok(begin(client, root, step, 0, 1))
            files: Files = []
            for i in range(count):
                rel = f"shards/{i % 30}/f{i}"
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_bytes(b"z" * 16)
                files.append({"path": rel, "size": 16})
            ok(done(client, root, step, 0, files))
            daemon.wait_event("checkpoint.promoting", TIMEOUT, of(root, step))
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            assert daemon.proc.wait(60) == 0
        daemon.wait_event("daemon.stopped", TIMEOUT)
        order = names(daemon)
        assert order.count("checkpoint.promoted") == 1
        assert order.index("checkpoint.promoted") < order.index("daemon.stopped")
        assert order.index("daemon.signal") < order.index("checkpoint.promoted"), (
            "SIGTERM arrived only after the promotion finished; the test did not overlap"
        )
        assert not tmp.exists()
        manifest = json.loads((root / f"step_{step}" / ".ckptd-manifest.json").read_bytes())
        assert len(manifest["files"]) == count
        assert sum(1 for _ in (root / f"step_{step}" / "shards").rglob("f*")) == count
        assert os.readlink(root / "latest") == f"step_{step}"


class TestManyClients:
    """Fifty ranks on fifty concurrent connections make one promotion."""

    def test_fifty_ranks(self, start: Start, root: Path) -> None:
        daemon = start([root])
        world, step = 50, 81
        tmp = root / f"tmp_step_{step}"
        tmp.mkdir()
        barrier = threading.Barrier(world, timeout=TIMEOUT)
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                with connect(daemon) as client:
                    barrier.wait()
                    ok(begin(client, root, step, r, world))
                    files = write_files(tmp, r, count=1, size=10)
                    barrier.wait()  # every connection stays open until all have begun
                    ok(done(client, root, step, r, files))
                    assert ok(wait(client, root, step))["state"] == "promoted"
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT * 2)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        event = daemon.wait_event("checkpoint.promoted", TIMEOUT, of(root, step))
        assert event["files"] == world
        assert daemon.stop() == 0
        order = names(daemon)
        assert order.count("checkpoint.promoted") == 1
        assert order.count("save.begun") == world
        assert order.count("save.rank_done") == world
        assert len(list((root / f"step_{step}" / "model").iterdir())) == world
