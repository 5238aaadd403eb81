"""Benchmark 2: promotion latency, from the last rank's ``done`` reply to ``checkpoint.promoted``.

A daemon with one root; a subscriber connection follows its events. Each sample is a
2-rank save of ``F`` files (10, 100, 1,000) written by this process as a writer would:
both ranks ``begin``, the files are written and fsynced (the raw upload, timed: the
baseline), both ranks send ``done`` with their files and sizes, and the clock runs from
the second ``done`` reply to the ``checkpoint.promoted`` event on the subscriber. Between samples,
one small ``write`` + ``fsync`` measures this disk's flush latency, the unit every
durable step of promotion pays. What
the daemon does in between is all of promotion: verify every file, write the manifest,
fsync files and directories, journal the intent, rename, fsync the root, move
``latest``, journal the outcome.

Real 2-rank DCP saves are measured in benchmark 1, which reports the same latency from
the daemon's own ``save.rank_done`` and ``checkpoint.promoted`` timestamps.

    .venv/bin/python -m bench.promotion [--full] [--files 10,100,1000] [--reps 20]
        [--tree OTHER_CHECKOUT]   # also measure another build's daemon, same run

With ``--tree``, each other checkout's daemon runs beside this one (its own root and
state directory) and gets the same samples, interleaved round by round, so a change is
compared against its baseline under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ._common import REPO, BenchResult, Daemon, Row, median, p99, print_table, scratch_dir

__all__ = ["run"]

_FILE_BYTES = 64 * 1024


class _Line:
    """A blocking newline-JSON connection to the daemon."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60.0)
        self.sock.connect(path)
        self.file = self.sock.makefile("rb")
        self.next_id = 0

    def send(self, op: str, **fields: Any) -> int:
        self.next_id += 1
        line = json.dumps({"op": op, "id": self.next_id, **fields}).encode() + b"\n"
        self.sock.sendall(line)
        return self.next_id

    def recv(self) -> dict[str, Any]:
        line = self.file.readline()
        if not line:
            raise ConnectionError("daemon closed the connection")
        obj: dict[str, Any] = json.loads(line)
        return obj

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        rid = self.send(op, **fields)
        while True:
            reply = self.recv()
            if reply.get("id") == rid:
                if not reply.get("ok"):
                    raise RuntimeError(f"{op} refused: {reply}")
                return reply

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def _write_files(tmp: Path, rank: int, count: int, block: bytes) -> list[dict[str, Any]]:
    """Write this rank's ``count`` files, then fsync each: a writer's upload."""
    folder = tmp / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    fds = []
    entries = []
    for i in range(count):
        path = folder / f"shard_{i:05d}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, block)
        fds.append(fd)
        entries.append({"path": f"rank{rank}/{path.name}", "size": len(block)})
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return entries


def _fsync_latency(root: Path) -> float:
    """Seconds for one small ``write`` + ``fsync`` in ``root``: one flush of this disk."""
    path = root / ".fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"x" * 512)
        start = time.perf_counter()
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)


def _one(
    root: Path, step: int, files: int, ranks: list[_Line], events: _Line, block: bytes
) -> dict[str, float]:
    rootp = str(root)
    tmp = root / f"tmp_step_{step}"
    for rank, conn in enumerate(ranks):
        conn.call("begin", root=rootp, step=step, rank=rank, world_size=len(ranks))
    start = time.perf_counter()
    per_rank = [files // len(ranks) + (r < files % len(ranks)) for r in range(len(ranks))]
    written = [_write_files(tmp, r, n, block) for r, n in enumerate(per_rank)]
    upload = time.perf_counter() - start
    for rank, conn in enumerate(ranks):
        conn.call("done", root=rootp, step=step, rank=rank, files=written[rank])
    last_done = time.perf_counter()
    while True:
        event = events.recv()
        if event.get("event") == "checkpoint.promoted" and event.get("step") == step:
            promoted = time.perf_counter()
            break
        if event.get("event") == "checkpoint.failed" and event.get("step") == step:
            raise RuntimeError(f"step {step} failed: {event}")
    return {
        "upload_ms": upload * 1000,
        "latency_ms": (promoted - last_done) * 1000,
        "promotion_ms": float(event["promotion_ms"]),
        "files": float(event["files"]),
    }


def run(
    quick: bool = True,
    *,
    files: list[int] | None = None,
    reps: int | None = None,
    trees: list[Path] | None = None,
) -> BenchResult:
    """Run benchmark 2.

    Args:
        quick: 15 samples per size (5 at 1,000 files); full: 50 (20).
        files: File counts per checkpoint (default 10, 100, 1,000).
        reps: Samples per file count (overrides the mode).
        trees: Other source trees whose daemon to measure as well, interleaved.
    """
    counts = files or [10, 100, 1000]
    block = os.urandom(_FILE_BYTES)
    labels = ["ckptd", *(f"ckptd ({t.name})" for t in trees or [])]
    sources = [REPO, *(trees or [])]
    samples: dict[str, dict[int, list[dict[str, float]]]] = {
        label: {n: [] for n in counts} for label in labels
    }
    fsyncs: list[float] = []
    with ExitStack() as stack:
        targets = []
        for tree in sources:
            work = stack.enter_context(scratch_dir())
            root = work / "run"
            root.mkdir()
            daemon = stack.enter_context(Daemon(work, [root], tree=tree))
            ranks = [_Line(daemon.socket) for _ in range(2)]
            events = _Line(daemon.socket)
            events.call("subscribe")
            for conn in [*ranks, events]:
                stack.callback(conn.close)
            targets.append((root, ranks, events))
        step = 0
        per_count = {
            n: reps or ((15 if n < 1000 else 5) if quick else (50 if n < 1000 else 20))
            for n in counts
        }
        # Interleave file counts (and trees, in rotating order) so drift on a loaded
        # machine hits them alike; the first round is a warm-up.
        for round_no in range(max(per_count.values()) + 1):
            for n in counts:
                if round_no > per_count[n]:
                    continue
                step += 1
                shift = round_no % len(targets)
                for i in [*range(shift, len(targets)), *range(shift)]:
                    root, ranks, events = targets[i]
                    sample = _one(root, step, n, ranks, events, block)
                    if round_no > 0:
                        samples[labels[i]][n].append(sample)
                    shutil.rmtree(root / f"step_{step}", ignore_errors=True)
                flush_ms = _fsync_latency(targets[0][0]) * 1000
                if round_no > 0:
                    fsyncs.append(flush_ms)
    rows: list[Row] = []
    p50s: dict[int, float] = {}
    for n in counts:
        lat = [s["latency_ms"] for s in samples["ckptd"][n]]
        up = [s["upload_ms"] for s in samples["ckptd"][n]]
        p50s[n] = median(lat)
        row = Row("promotion", f"{n} files", "last done -> promoted", "ms", median(lat))
        row.p99, row.n = p99(lat), len(lat)
        row.baseline, row.baseline_name = median(up), "raw upload"
        row.ratio = row.median / row.baseline
        row.note = "ratio: time promotion adds over the upload itself"
        if n == 100:
            row.target, row.met = "p50 < 10 ms", row.median < 10.0
        rows.append(row)
        for label in labels[1:]:
            other = [s["latency_ms"] for s in samples[label][n]]
            row = Row("promotion", f"{n} files, {label}", "last done -> promoted", "ms", 0.0)
            row.median, row.p99, row.n = median(other), p99(other), len(other)
            row.baseline, row.baseline_name = p50s[n], "this tree"
            row.ratio = row.median / p50s[n]
            row.note = "the other tree's daemon, same samples interleaved"
            rows.append(row)
    flush = Row("promotion", "one small write", "fsync latency", "ms", median(fsyncs))
    flush.p99, flush.n = p99(fsyncs), len(fsyncs)
    flush.note = "this disk's flush, measured between the samples: the unit promotion pays"
    rows.append(flush)
    for n in counts:
        in_flushes = Row("promotion", f"{n} files", "latency / fsync", "x", p50s[n] / flush.median)
        in_flushes.note = "promotion p50 / fsync p50: serialized flushes, roughly"
        rows.append(in_flushes)
    ordered = sorted(counts)
    for small, big in zip(ordered, ordered[1:], strict=False):
        growth = p50s[big] / p50s[small]
        row = Row("promotion", f"{small} -> {big} files", "p50 growth", "x", growth)
        row.baseline, row.baseline_name = big / small, "linear"
        row.ratio = growth / (big / small)
        row.target, row.met = "<= linear", growth <= big / small
        rows.append(row)
    raw: dict[str, Any] = {str(n): samples["ckptd"][n] for n in counts}
    raw["fsync_ms"] = fsyncs
    for label in labels[1:]:
        raw[label] = {str(n): samples[label][n] for n in counts}
    return BenchResult(rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--files", help="comma-separated file counts")
    parser.add_argument("--reps", type=int)
    parser.add_argument("--tree", type=Path, action="append", default=[])
    args = parser.parse_args()
    counts = [int(n) for n in args.files.split(",")] if args.files else None
    print_table(run(not args.full, files=counts, reps=args.reps, trees=args.tree).rows)


if __name__ == "__main__":
    main()
