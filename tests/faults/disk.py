"""Disk faults: a real, small, full tmpfs under the checkpoints or under the journal.

- During writes: the root is an 8 MiB tmpfs; a real 2-rank DCP job promotes step 1, the
  filesystem is then filled, step 2's upload fails with ``ENOSPC``, space is freed and
  step 3 promotes.
- During promotion: the root is a 4 MiB tmpfs; a real DCP save (written by the harness as
  a one-rank job, so it can act between the data landing and ``done``) fills the
  filesystem to the last byte just before ``done``, so verification passes and the
  manifest, the first thing promotion writes, gets ``ENOSPC``. A FIFO gate or a crash
  point cannot pause the daemon there; filling the disk in that gap is what a trainer
  writing logs next to its checkpoints does.
- Journal: ``--state-dir`` is a 256 KiB tmpfs, filled while saves are in flight.

Where the machine refuses the mount (no root or no ``CAP_SYS_ADMIN``) each scenario is
skipped with the reason; the EIO injected at DCP's storage boundary
(:func:`tests.faults.ranks.writer_exception`) runs everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from daemon import verify_checkpoint
from daemon.store._attempts import TRASH
from orchestrator.protocol import ATTEMPT_MARKER
from tests._dcp_worker import state_for
from tests.conftest import LineClient
from tests.faults.harness import (
    FaultDaemon,
    Outcome,
    Ranks,
    Result,
    fill,
    release,
    run_scenarios,
    small_tmpfs,
)

__all__ = ["SCENARIOS", "run_disk_faults"]

_NO_SPACE = os.strerror(errno.ENOSPC)


def _expect(outcome: Outcome, ok: bool, message: str) -> None:
    if not ok:
        outcome.violations.append(message)


def _listing(path: Path) -> dict[str, int]:
    """Every file under ``path`` with its size."""
    return {
        str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()
    }


@contextlib.contextmanager
def _daemon(root: Path, workdir: Path, *flags: str) -> Iterator[FaultDaemon]:
    daemon = FaultDaemon(workdir / "d.sock", [root], *flags, state_dir=workdir / "state")
    try:
        yield daemon.start()
    finally:
        daemon.reap()


def enospc_during_write(workdir: Path) -> Outcome:
    """The checkpoint filesystem fills while ranks write step 2."""
    out = Outcome(
        "filesystem full during the ranks' writes (8 MiB tmpfs)",
        "checkpoint.failed with the ENOSPC reason; nothing promoted; step_1 untouched and "
        "verifies; the daemon keeps serving: step 3 promotes once space is freed",
    )
    gate = workdir / "gate"
    os.mkfifo(gate)
    with small_tmpfs(workdir / "mnt", "8m") as mnt, _daemon(mnt, workdir) as daemon:
        args = ("--steps", "1,2,3", "--pause-before", "2,3", "--gate", str(gate))
        ranks = Ranks(daemon.socket_path, mnt, 2, *args, "--numel", "65536")
        try:
            ranks.wait_line("held", at="step2", timeout=120)
            first = daemon.request("wait", root=str(mnt), step=1, timeout=60)
            before = _listing(mnt / "step_1")
            filler = fill(mnt, leave=64 * 1024)
            release(gate)
            failed = daemon.wait_event("checkpoint.failed", timeout=60)
            served = daemon.request("ping")["ok"]
            filler.unlink()
            ranks.wait_line("held", at="step3", timeout=60)
            release(gate)
            codes = ranks.wait(120)
        finally:
            ranks.kill()
        third = daemon.request("wait", root=str(mnt), step=3, timeout=60)
        _expect(out, first["state"] == "promoted", f"step 1: {first}")
        # The reason names the failed rank and carries DCP's exception; whether that text
        # says ENOSPC is torch's choice (its zip writer may report "unexpected pos").
        reason = failed["reason"]
        _expect(out, failed["step"] == 2 and "CheckpointException" in reason, reason[:300])
        _expect(out, not (mnt / "step_2").exists(), "step_2 promoted")
        _expect(out, _listing(mnt / "step_1") == before, "step_1 changed")
        _expect(out, verify_checkpoint(str(mnt / "step_1")) == [], "step_1 fails verify")
        _expect(out, served and third["state"] == "promoted", f"ping {served}, step 3 {third}")
        _expect(out, os.readlink(mnt / "latest") == "step_3", "latest is not step_3")
        _expect(out, codes == [0, 0], f"ranks exited {codes}: {ranks.output()}")
        named = "names ENOSPC" if _NO_SPACE in reason else "ENOSPC not named by torch"
        out.observed = f"checkpoint.failed: {reason[:110]}... ({named}); step 3: {third['state']}"
    return out


def _dcp_step(client: LineClient, root: Path, step: int) -> list[dict[str, Any]]:
    """Begin ``step`` as a one-rank job and write it with a real DCP save."""
    reply = client.request("begin", root=str(root), step=step, rank=0, world_size=1)
    assert reply["ok"], reply
    tmp = root / f"tmp_step_{step}"
    dcp_save(state_for(0, step, 16384), checkpoint_id=str(tmp), no_dist=True)
    # What the rank wrote: everything but the attempt marker the daemon put there.
    wrote = {rel: size for rel, size in _listing(tmp).items() if rel != ATTEMPT_MARKER}
    return [{"path": rel, "size": size} for rel, size in wrote.items()]


def enospc_during_promotion(workdir: Path) -> Outcome:
    """The checkpoint filesystem is full when promotion writes its first file."""
    out = Outcome(
        "filesystem full when promotion starts (4 MiB tmpfs)",
        "checkpoint.failed 'promotion failed: write node marker failed ...: No space left on "
        "device'; nothing visible as step_N; the failed attempt's directory set aside "
        "intact (no manifest, no temporary file); step_1 untouched; the daemon keeps serving",
    )
    with small_tmpfs(workdir / "mnt", "4m") as mnt, _daemon(mnt, workdir) as daemon:
        with LineClient(daemon.socket_path, timeout=60) as client:
            files = _dcp_step(client, mnt, 1)
            client.request("done", root=str(mnt), step=1, rank=0, files=files)
            first = client.request("wait", root=str(mnt), step=1, timeout=60)
            files = _dcp_step(client, mnt, 2)
            before = _listing(mnt / "tmp_step_2")
            filler = fill(mnt)
            done = client.request("done", root=str(mnt), step=2, rank=0, files=files)
            second = client.request("wait", root=str(mnt), step=2, timeout=60)
            filler.unlink()
            files = _dcp_step(client, mnt, 3)
            client.request("done", root=str(mnt), step=3, rank=0, files=files)
            third = client.request("wait", root=str(mnt), step=3, timeout=60)
        reason = out.evidence["reason"] = str(second.get("reason"))
        _expect(out, first["state"] == "promoted" and done["ok"], f"step 1 {first}, done {done}")
        _expect(out, second["state"] == "failed", f"step 2: {second}")
        _expect(out, "write node marker" in reason and _NO_SPACE in reason, f"reason: {reason}")
        _expect(out, not (mnt / "step_2").exists(), "step_2 visible")
        # A failed attempt's directory goes into the root's trash (guarantees 4a).
        aside = [p for p in (mnt / TRASH).glob("tmp_step_2.attempt-*") if p.is_dir()]
        kept = [_listing(p) for p in aside]
        _expect(out, not (mnt / "tmp_step_2").exists(), "tmp_step_2 not set aside")
        _expect(out, kept == [before], f"set aside {kept}, written {before}")
        _expect(out, verify_checkpoint(str(mnt / "step_1")) == [], "step_1 fails verify")
        _expect(out, third["state"] == "promoted", f"step 3: {third}")
        out.observed = f"step 2 failed: {reason[:160]}; step 3: {third['state']}"
    return out


def _begin_both(client: LineClient, root: Path, step: int) -> list[dict[str, Any]]:
    return [
        client.request("begin", root=str(root), step=step, rank=r, world_size=2) for r in (0, 1)
    ]


def _files(root: Path, step: int, rank: int, repeat: int = 1) -> list[dict[str, Any]]:
    """Write rank ``rank``'s file of ``step``; list it ``repeat`` times (a big record)."""
    tmp = root / f"tmp_step_{step}"
    tmp.mkdir(exist_ok=True)
    (tmp / f"r{rank}.bin").write_bytes(bytes([rank]) * 1000)
    return [{"path": f"r{rank}.bin", "size": 1000}] * repeat


def journal_full(workdir: Path, *, retry: bool = False) -> Outcome:
    """The journal's filesystem fills while saves are in flight, then space is freed.

    tmpfs allocates whole pages, so a small record may still fit in the journal's last
    page of a full filesystem; the refused changes are large records (a ``done`` listing
    one file 2,000 times, a ``fail`` with a 4 KiB reason) that need new pages.
    """
    out = Outcome(
        "journal filesystem full (256 KiB tmpfs)" + (", refused done retried" if retry else ""),
        "changes get 'unavailable' (not acknowledged) while reads are still served; once "
        "space is freed requests succeed; after a SIGKILL and restart everything "
        "acknowledged is there"
        + ("; a retried done that got 'ok' is acknowledged" if retry else ""),
    )
    root = workdir / "run"
    root.mkdir()
    with small_tmpfs(workdir / "state", "256k") as state:
        daemon = FaultDaemon(workdir / "d.sock", [root], state_dir=state).start()
        try:
            with LineClient(daemon.socket_path) as client:
                _begin_both(client, root, 1)
                for rank in (0, 1):
                    client.request(
                        "done", root=str(root), step=1, rank=rank, files=_files(root, 1, rank)
                    )
                first = client.request("wait", root=str(root), step=1, timeout=30)
                begun = _begin_both(client, root, 2) + _begin_both(client, root, 3)
                filler = fill(state)
                big = _files(root, 2, 0, repeat=2000)
                refused = [
                    client.request("done", root=str(root), step=2, rank=0, files=big),
                    client.request("fail", root=str(root), step=3, rank=0, reason="r" * 4096),
                ]
                if retry:  # the bundled client retries 'unavailable' every half second
                    refused.append(
                        client.request("done", root=str(root), step=2, rank=0, files=big)
                    )
                served = client.request("status")["ok"]
                logged = daemon.wait_event("journal.failed", timeout=30)
                filler.unlink()
                again = {"ok": True}
                if retry:
                    again = client.request("done", root=str(root), step=2, rank=0, files=big)
                after = client.request(
                    "done", root=str(root), step=2, rank=1, files=_files(root, 2, 1)
                )
            daemon.reap(signal.SIGKILL)
            daemon = FaultDaemon(workdir / "d.sock", [root], state_dir=state).start()
            saves = {s["step"]: s for s in daemon.request("status")["saves"]}
        finally:
            daemon.reap()
    codes = [r.get("error", {}).get("code") for r in refused]
    ranks2 = {r["rank"]: r["state"] for r in saves.get(2, {}).get("ranks", [])}
    _expect(out, first["state"] == "promoted" and all(b["ok"] for b in begun), "setup failed")
    _expect(out, set(codes) == {"unavailable"}, f"while full: {[str(r)[:200] for r in refused]}")
    _expect(out, _NO_SPACE in logged["error"], f"journal.failed: {logged}")
    _expect(out, served, "status refused while the journal was full")
    _expect(out, after["ok"] and again["ok"], f"after freeing: {after}, retried: {again}")
    _expect(out, saves.get(1, {}).get("state") == "promoted", f"step 1 after restart: {saves}")
    # Acknowledged: rank 1's done, and rank 0's retried done. (A change answered
    # 'unavailable' was not acknowledged: it may or may not have been written later.)
    want = {0: "done", 1: "done"} if retry else {1: "done"}
    got = {r: ranks2.get(r) for r in want}
    _expect(
        out,
        got == want or saves.get(2, {}).get("state") == "promoted",
        f"acknowledged done lost after the restart: step 2 ranks {ranks2}",
    )
    out.observed = f"while full: {codes}; after restart step 2 ranks: {ranks2}"
    return out


def journal_full_retry(workdir: Path) -> Outcome:
    """As :func:`journal_full`, with the refused ``done`` retried (the client's behaviour)."""
    return journal_full(workdir, retry=True)


SCENARIOS: dict[str, Callable[[Path], Outcome]] = {
    "enospc_during_write": enospc_during_write,
    "enospc_during_promotion": enospc_during_promotion,
    "journal_full": journal_full,
    "journal_full_retry": journal_full_retry,
}
"""Every disk fault, by name."""


def run_disk_faults(
    workdir: Path, rounds: int = 1, progress: Callable[[str], None] = lambda _m: None
) -> Result:
    """Run every disk-fault scenario ``rounds`` times, each in a fresh directory."""
    return run_scenarios("disk", SCENARIOS, workdir, rounds, progress)
