"""Benchmark 8: retiring a large checkpoint does not delay the next promotion.

One daemon, two roots on the same disk: ``plain`` has no retention policy, ``kept`` has
``keep_last = 1``. Each round:

1. a checkpoint of ``F`` files (100,000 with ``--full``) is put into ``kept`` as
   ``step_M``, as a promoted checkpoint looks (its files, and a manifest listing them);
   a dry-run ``retention`` request lets the daemon see it, as it would have at its own
   promotion;
2. ``plain`` promotes a few 100-file steps with nothing being deleted: the baseline;
3. ``kept`` promotes a 100-file step A: its pass retires ``step_M`` (renamed into the
   trash, deleted in the background); once ``checkpoint.retired`` says so, ``kept``
   promotes step B, *the next promotion*, and more steps while the deletion runs.

Latency is from the last rank's ``done`` reply to the ``checkpoint.promoted`` event, as
in benchmark 2. The figure: the next promotion's median against the baseline's median,
same run; the target is at most 1.2x. Promotions that end after ``checkpoint.deleted``
(the deletion was over) are counted apart.

    .venv/bin/python -m bench.retention [--full] [--files 100000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import os
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ._common import BenchResult, Daemon, Row, median, p99, parse_ts, print_table, scratch_dir
from .promotion import _Line, _one

__all__ = ["run"]

_SMALL = 100
"""Files of each promoted step (as benchmark 2's middle size)."""


def _big_step(root: Path, step: int, files: int) -> None:
    """A promoted-looking ``step_N`` of ``files`` one-byte files in 1,000-file folders."""
    final = root / f"step_{step}"
    listed: dict[str, int] = {}
    for i in range(files):
        folder = final / f"shard{i // 1000:03d}"
        if i % 1000 == 0:
            folder.mkdir(parents=True)
        rel = f"shard{i // 1000:03d}/f{i:06d}.bin"
        fd = os.open(final / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, b"x")
        os.close(fd)
        listed[rel] = 1
    manifest = {
        "format": "ckptd-manifest/1",
        "root": str(root),
        "step": step,
        "world_size": 1,
        "created": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "bytes": files,
        "files": listed,
        "dirs": ["."],
        "dcp_dirs": [],
    }
    (final / ".ckptd-manifest.json").write_text(json.dumps(manifest))


class _Recording(_Line):
    """The event subscription, keeping every event it reads."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.seen: list[dict[str, Any]] = []

    def recv(self) -> dict[str, Any]:
        event = super().recv()
        self.seen.append(event)
        return event

    def find(self, name: str, step: int) -> dict[str, Any] | None:
        for event in self.seen:
            if event.get("event") == name and event.get("step") == step:
                return event
        return None

    def until(self, name: str, step: int) -> dict[str, Any]:
        while (found := self.find(name, step)) is None:
            self.recv()
        return found


def run(quick: bool = True, *, files: int | None = None, rounds: int | None = None) -> BenchResult:
    """Run benchmark 8.

    Args:
        quick: 20,000 files, 3 rounds; full: 100,000 files, 8 rounds.
        files: Files of the retired checkpoint (overrides the mode).
        rounds: Rounds (overrides the mode).
    """
    count = files or (20_000 if quick else 100_000)
    n_rounds = rounds or (3 if quick else 8)
    block = os.urandom(64 * 1024)
    base: list[float] = []
    nxt: list[float] = []
    during: list[float] = []
    after: list[float] = []
    delete_s: list[float] = []
    with ExitStack() as stack:
        work = stack.enter_context(scratch_dir())
        plain, kept = work / "plain", work / "kept"
        plain.mkdir()
        kept.mkdir()
        config = work / "ckptd.toml"
        config.write_text(
            f'[[roots]]\npath = "{plain}"\n\n[[roots]]\npath = "{kept}"\n\n'
            "[roots.retention]\nkeep_last = 1\n"
        )
        daemon = stack.enter_context(Daemon(work, [], extra=["--config", str(config)]))
        ranks = [_Line(daemon.socket) for _ in range(2)]
        events = _Recording(daemon.socket)
        events.call("subscribe")
        control = _Line(daemon.socket)
        for conn in [*ranks, events, control]:
            stack.callback(conn.close)
        step = 0
        for _ in range(3):  # warm-up: both roots, both paths
            step += 1
            _one(plain, step, _SMALL, ranks, events, block)
            _one(kept, step, _SMALL, ranks, events, block)
        for _round in range(n_rounds):
            step += 1
            big = step
            _big_step(kept, big, count)
            control.call("retention", root=str(kept))  # seen: its manifest is read now
            events.seen.clear()
            for _ in range(3):
                step += 1
                base.append(_one(plain, step, _SMALL, ranks, events, block)["latency_ms"])
            step += 1
            _one(kept, step, _SMALL, ranks, events, block)  # A: its pass retires `big`
            events.until("checkpoint.retired", big)
            first = True
            while True:
                step += 1
                sample = _one(kept, step, _SMALL, ranks, events, block)["latency_ms"]
                deleted = events.find("checkpoint.deleted", big) is not None
                if first:
                    nxt.append(sample)
                    first = False
                (after if deleted else during).append(sample)
                if deleted or len(during) > 500:
                    break
            gone = events.until("checkpoint.deleted", big)
            began = events.until("checkpoint.retired", big)
            delete_s.append(parse_ts(gone["timestamp"]) - parse_ts(began["timestamp"]))
    ratio_base = median(base)
    rows = []
    row = Row(
        "retention", f"next promotion, {count:,} files retiring", "latency", "ms", median(nxt)
    )
    row.p99, row.n = p99(nxt), len(nxt)
    row.baseline, row.baseline_name = ratio_base, "no retention"
    row.ratio = row.median / ratio_base
    row.target, row.met = "<= 1.2x", row.ratio <= 1.2
    row.note = "100-file promotion right after a pass retired the large checkpoint"
    rows.append(row)
    if during:  # none when the deletion ended before the next promotion did
        row = Row("retention", "promotions during the deletion", "latency", "ms", median(during))
        row.p99, row.n = p99(during), len(during)
        row.baseline, row.baseline_name = ratio_base, "no retention"
        row.ratio = row.median / ratio_base
        row.note = "every promotion that ended before checkpoint.deleted"
        rows.append(row)
    row = Row("retention", "baseline, 100 files", "latency", "ms", ratio_base)
    row.p99, row.n = p99(base), len(base)
    row.note = "a root without a policy, nothing being deleted, same daemon and disk"
    rows.append(row)
    row = Row("retention", f"deleting {count:,} files", "retired -> deleted", "s", median(delete_s))
    row.p99, row.n = p99(delete_s), len(delete_s)
    row.note = "in the background, pausing while the root promotes"
    rows.append(row)
    raw = {"files": count, "baseline_ms": base, "next_ms": nxt, "during_ms": during}
    raw["delete_s"] = delete_s
    raw["after_ms"] = after
    return BenchResult(rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--files", type=int)
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args()
    print_table(run(not args.full, files=args.files, rounds=args.rounds).rows)


if __name__ == "__main__":
    main()
