"""Protocol fuzzing against a real daemon while a well-behaved job saves through it.

Hypothesis draws batches of frames: well-formed requests with wrong fields (every op,
each field valid, of the wrong type, out of range, or missing; unknown and unnormalised
roots, ``..`` and absolute file paths, huge ``files`` lists), arbitrary JSON values,
random bytes with and without newlines, lines over the 1 MiB bound, and hand-picked
nasty lines (deep nesting, invalid UTF-8, lone surrogates, 10,000-digit numbers). Each
batch goes to one of several connections; now and then a connection hangs up mid-line.

Checked throughout: one reply per complete non-blank line (counted with the same
framing rules the daemon documents), every reply a documented shape whose error code is
documented and never ``internal``, no reply carrying an id that connection never sent,
the daemon alive, its RSS within a bound of its size after warm-up, and a concurrent
2-rank save loop on another root promoting every step it saves.

The fuzzer never sends a valid request naming the job's root: a permitted peer may
legitimately ``fail`` another job's step, which is not bad input. Its valid requests use
a root of its own, with steps, ranks and world sizes drawn from small ranges so that the
state they legitimately create stays bounded and memory growth means a leak.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, seed, settings

from tests.conftest import LineClient
from tests.faults.frames import CODES, Batch, batches, expected_replies, ids_in
from tests.faults.harness import FaultDaemon, Result, reader_race_tracebacks

__all__ = ["run_fuzz_campaign"]


class _Conn:
    """One fuzzing connection with a thread reading every line the daemon sends."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(str(path))
        self.replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.owed = 0
        self.ids: set[int] = set()
        self.events = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        with self.sock.makefile("rb") as fh:
            try:
                for line in fh:
                    if line.startswith(b'{"event":'):
                        self.events += 1  # subscribed: events interleave with replies
                    else:
                        self.replies.put(json.loads(line))
            except (OSError, ValueError):
                pass
        self.replies.put(None)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already reset by the daemon
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader: it sees end of file
        self.sock.close()
        self._reader.join(30)


@dataclass(slots=True)
class _Fuzz:
    daemon: FaultDaemon
    conns: list[_Conn]
    result: Result
    frames: int = 0
    lines: int = 0
    replies: int = 0
    hang_ups: int = 0
    bytes: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    closed: list[str] = field(default_factory=list)
    dead: bool = False

    def send(self, batch: Batch) -> None:
        conn = self.conns[batch.conn]
        data = b"".join(batch.frames)
        if batch.hang_up:
            data += b'{"op":"ping","id":'  # half a line: dropped, never answered
        elif not data.endswith(b"\n"):
            data += b"\n"
        owed = expected_replies(data)
        for frame in batch.frames:
            conn.ids |= ids_in(frame)
        try:
            conn.sock.sendall(data)
        except OSError as exc:
            self.violate(f"send failed: {exc!r}")
        self.frames += len(batch.frames)
        self.lines += owed
        self.bytes += len(data)
        got = self._collect(conn, owed)
        if batch.hang_up or got < owed:
            self.hang_ups += batch.hang_up
            conn.close()
            self.conns[batch.conn] = _Conn(self.daemon.socket_path)
        assert self.daemon.proc is not None
        if self.daemon.proc.poll() is not None:
            self.dead = True
            self.violate(f"daemon died: {self.daemon.stdout[-10:]}")

    def _collect(self, conn: _Conn, owed: int) -> int:
        deadline = time.monotonic() + 60
        got = 0
        while got < owed:
            try:
                reply = conn.replies.get(timeout=max(0.001, deadline - time.monotonic()))
            except queue.Empty:
                self.violate(f"{owed - got} of {owed} replies missing after 60 s")
                return got
            if reply is None:
                # Excused only if the daemon cut off a subscriber that fell behind.
                self.closed.append(f"closed by the daemon with {owed - got} of {owed} owed")
                return got
            got += 1
            self.replies += 1
            self._check(conn, reply)
        return got

    def _check(self, conn: _Conn, reply: Any) -> None:
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            self.violate(f"reply of no documented shape: {str(reply)[:200]}")
            return
        rid = reply.get("id", "missing")
        if rid is not None and rid not in conn.ids:
            self.violate(f"reply with an id never sent on this connection: {str(reply)[:200]}")
        if reply["ok"]:
            self.codes["ok"] += 1
            return
        code = (reply.get("error") or {}).get("code")
        self.codes[str(code)] += 1
        if code not in CODES or code == "internal":
            self.violate(f"error reply with code {code!r}: {str(reply)[:300]}")

    def violate(self, message: str) -> None:
        if len(self.result.violations) < 200:
            self.result.violations.append(message)


def _job(daemon: FaultDaemon, root: Path, stop: threading.Event, result: dict[str, Any]) -> None:
    """A well-behaved 2-rank save loop: each step must be promoted."""
    result.update(promoted=0, failed=[], slowest_s=0.0)
    try:
        _save_loop(daemon, root, stop, result)
    except Exception as exc:  # reported as a finding, not lost in a thread
        result["failed"].append(f"the job's connection broke: {exc!r}")


def _save_loop(
    daemon: FaultDaemon, root: Path, stop: threading.Event, result: dict[str, Any]
) -> None:
    step = 0
    with LineClient(daemon.socket_path) as r0, LineClient(daemon.socket_path) as r1:
        while not stop.is_set():
            step += 1
            begun = time.monotonic()
            for rank, client in enumerate((r0, r1)):
                reply = client.request("begin", root=str(root), step=step, rank=rank, world_size=2)
                if not reply.get("ok"):
                    result["failed"].append(f"begin {step}: {reply}")
            tmp = root / f"tmp_step_{step}"
            tmp.mkdir(exist_ok=True)
            for rank, client in enumerate((r0, r1)):
                (tmp / f"r{rank}.bin").write_bytes(bytes([rank]) * 4096)
                files = [{"path": f"r{rank}.bin", "size": 4096}]
                reply = client.request("done", root=str(root), step=step, rank=rank, files=files)
                if not reply.get("ok"):
                    result["failed"].append(f"done {step}: {reply}")
            reply = r0.request("wait", root=str(root), step=step, timeout=60)
            if reply.get("state") == "promoted":
                result["promoted"] += 1
            else:
                result["failed"].append(f"step {step}: {reply}")
            result["slowest_s"] = max(result["slowest_s"], time.monotonic() - begun)


def run_fuzz_campaign(
    workdir: Path,
    frames: int,
    *,
    seed_: int = 0,
    connections: int = 4,
    rss_bound_mib: float = 50.0,
    progress: Callable[[str], None] = lambda _m: None,
) -> Result:
    """Send at least ``frames`` fuzzed frames to a real daemon; see the module docstring."""
    started = time.monotonic()
    result = Result("fuzz")
    job_root, fuzz_root = workdir / "job", workdir / "fuzz"
    job_root.mkdir()
    fuzz_root.mkdir()
    daemon = FaultDaemon(
        workdir / "d.sock",
        [job_root, fuzz_root],
        state_dir=workdir / "state",
        counted=frozenset({"request.rejected", "client.connected", "client.disconnected"}),
    ).start()
    stop = threading.Event()
    job: dict[str, Any] = {}
    job_thread = threading.Thread(target=_job, args=(daemon, job_root, stop, job), daemon=True)
    job_thread.start()
    fuzz = _Fuzz(daemon, [_Conn(daemon.socket_path) for _ in range(connections)], result)
    strategy = batches(str(fuzz_root), connections)
    rss_start = rss_max = 0
    try:
        round_ = 0
        while fuzz.frames < frames and not fuzz.dead:
            examples = max(10, min(200, (frames - fuzz.frames) // 8))

            @seed(seed_ * 1_000_003 + round_)
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(strategy)
            def one(batch: Batch) -> None:
                if not fuzz.dead:
                    fuzz.send(batch)

            one()
            round_ += 1
            rss = daemon.rss_kib() if not fuzz.dead else rss_max
            if round_ == 1:
                rss_start = rss  # after warm-up: every op, bad line and connection path ran
            rss_max = max(rss_max, rss)
            if round_ % 10 == 0:
                progress(
                    f"fuzz: {fuzz.frames}/{frames} frames, RSS {rss // 1024} MiB, "
                    f"{job.get('promoted')} job steps promoted"
                )
    finally:
        stop.set()
        job_thread.join(120)
        for conn in fuzz.conns:
            conn.close()
        alive = daemon.proc is not None and daemon.proc.poll() is None
        code = daemon.reap(signal.SIGTERM)  # a clean stop is part of surviving
    growth_mib = (rss_max - rss_start) / 1024
    if not alive or code != 0:
        result.violations.append(f"the daemon was not alive at the end (exit {code})")
    dropped = len(daemon.of("subscriber.dropped"))
    if len(fuzz.closed) > dropped:
        result.violations += fuzz.closed[dropped:][:10]
    if growth_mib > rss_bound_mib:
        result.violations.append(f"RSS grew {growth_mib:.1f} MiB (bound {rss_bound_mib} MiB)")
    internal = daemon.of("daemon.internal_error")
    result.violations += [f"internal error: {e}" for e in internal[:10]]
    races, other = reader_race_tracebacks(daemon.stdout)
    if other:
        result.violations.append(f"daemon printed non-JSON: {other[-10:]}")
    result.violations += [f"job: {f}" for f in job["failed"][:10]]
    if job["promoted"] < 1:
        result.violations.append("the well-behaved job promoted nothing")
    result.trials = fuzz.frames
    result.seconds = time.monotonic() - started
    result.figures.update(
        {
            "frames": fuzz.frames,
            "complete lines": fuzz.lines,
            "replies": fuzz.replies,
            "bytes sent": fuzz.bytes,
            "hang-ups mid-line": fuzz.hang_ups,
            "subscribers cut off": dropped,
            "asyncio reader-race tracebacks on stderr (see Findings)": races,
            "reply codes": dict(fuzz.codes.most_common()),
            "request.rejected events": daemon.counts["request.rejected"],
            "RSS after warm-up (MiB)": round(rss_start / 1024, 1),
            "RSS peak (MiB)": round(rss_max / 1024, 1),
            "RSS growth (MiB)": round(growth_mib, 1),
            "job steps promoted": job["promoted"],
            "job steps not promoted": len(job["failed"]),
            "job slowest save (s)": round(job["slowest_s"], 3),
        }
    )
    return result
