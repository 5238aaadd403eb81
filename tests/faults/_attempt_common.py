"""Shared by the attempt scenarios: their daemon and jobs, and what they check.

An attempt's files are known from what its ranks said they wrote
(``tests/faults/_attempt_worker.py``'s ``wrote`` lines: names and SHA-256, said before
the rank can report ``done``). A promoted ``step_N`` is compared with them name by name
and hash by hash; the set-aside directories in ``ROOT/.ckptd-trash`` likewise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from daemon import verify_checkpoint
from daemon.store._attempts import TRASH
from daemon.store._markers import NODE_PREFIX
from daemon.store._verify import MANIFEST_NAME
from orchestrator.protocol import ATTEMPT_MARKER
from tests.conftest import REPO
from tests.faults._attempt_worker import job_state, tensor_digest
from tests.faults.harness import FaultDaemon, Outcome, Ranks

__all__ = [
    "NUMEL",
    "PRE_BEGIN",
    "WORKER",
    "Checks",
    "check_promoted_attempt",
    "conns_of",
    "digests",
    "ended_cleanly",
    "held_mid_upload",
    "in_trash",
    "is_step",
    "job",
    "serving",
    "tree",
    "wait_settled",
    "whose_tensors",
    "written",
]

NUMEL = 1024
"""Elements of each rank's weight tensor."""

PRE_BEGIN = "training_info.json"
"""The file NeMo-RL writes into ``tmp_step_N`` before the step's save begins."""

WORKER = REPO / "tests" / "faults" / "_attempt_worker.py"
"""The rank script of every job here."""

_OURS = frozenset({MANIFEST_NAME, ATTEMPT_MARKER})


@contextlib.contextmanager
def serving(workdir: Path, *flags: str) -> Iterator[tuple[FaultDaemon, Path]]:
    """A daemon serving a fresh root ``workdir/run``; SIGKILLed and reaped at the end."""
    root = workdir / "run"
    root.mkdir()
    daemon = FaultDaemon(workdir / "d.sock", [root], *flags, state_dir=workdir / "state")
    try:
        yield daemon.start(), root
    finally:
        daemon.reap()


@contextlib.contextmanager
def job(daemon: FaultDaemon, root: Path, number: int, *args: str) -> Iterator[Ranks]:
    """A real 2-rank job ``number`` of the attempt worker; killed and reaped at the end."""
    ranks = Ranks(
        daemon.socket_path,
        root,
        2,
        "--job",
        str(number),
        "--numel",
        str(NUMEL),
        *args,
        script=WORKER,
    )
    try:
        yield ranks
    finally:
        ranks.kill()


def held_mid_upload(ranks: Ranks, step: int) -> None:
    """Wait until rank 1 is held before its shards and rank 0 has written its own."""
    ranks.wait_line("held", rank=1, at="write", timeout=120)
    ranks.wait_line("wrote", rank=0, step=step, pre_begin=None, timeout=120)


def wait_settled(
    daemon: FaultDaemon, root: Path, step: int, timeout: float = 60.0
) -> dict[str, Any]:
    """The daemon's ``wait`` reply for ``step``."""
    return daemon.request(
        "wait", io_timeout=timeout + 30, root=str(root), step=step, timeout=timeout
    )


class Checks:
    """Counts the invariants a scenario checked; each broken one is a violation."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        outcome.evidence.setdefault("checks", 0)

    def expect(self, ok: bool, message: str) -> bool:
        """Check one invariant; record ``message`` as a violation if it does not hold."""
        self.outcome.evidence["checks"] += 1
        if not ok:
            self.outcome.violations.append(message[:600])
        return ok

    def finding(self, ok: bool, message: str) -> bool:
        """Check an invariant a known defect breaks (docs/reliability.md, Findings).

        A break is recorded as evidence (``findings``), not as a violation, while the
        finding stands; its strict-xfail test in ``test_attempts.py`` fails once it is
        fixed, and the check is then made an :meth:`expect`.
        """
        self.outcome.evidence["checks"] += 1
        if not ok:
            self.outcome.evidence.setdefault("findings", []).append(message[:600])
        return ok

    def resumed(self, log: list[dict[str, Any]], *, step: int, job: int) -> None:
        """Every rank resumed from ``step`` and loaded job ``job``'s tensors of it."""
        for rank in (0, 1):
            lines = [x for x in log if x.get("event") == "resumed" and x["rank"] == rank]
            want = tensor_digest(job_state(rank, step, NUMEL, job))
            got = [(x["step"], x["digest"] == want) for x in lines]
            self.expect(got == [(step, True)], f"rank {rank} resumed {got}, not step {step}")


def is_step(step: int) -> Callable[[dict[str, Any]], bool]:
    """Matches events about ``step``."""
    return lambda e: e.get("step") == step


def written(log: Iterable[dict[str, Any]], *, step: int, job: int) -> dict[str, str]:
    """Every file job ``job``'s ranks said they wrote into step ``step``: name to SHA-256."""
    files: dict[str, str] = {}
    for line in log:
        if line.get("event") == "wrote" and (line["step"], line["job"]) == (step, job):
            files.update(line["files"])
    return files


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree(path: Path) -> dict[str, tuple[int, str]]:
    """Every file under ``path`` (relative name) with its size and SHA-256."""
    found: dict[str, tuple[int, str]] = {}
    for directory, _dirs, names in os.walk(path):
        for name in names:
            full = os.path.join(directory, name)
            if os.path.isfile(full) and not os.path.islink(full):
                found[os.path.relpath(full, path)] = (os.path.getsize(full), _sha256(full))
    return found


def digests(path: Path) -> dict[str, str]:
    """A step directory's files but ckptd's own (manifest, attempt and node markers)."""
    return {
        k: v[1] for k, v in tree(path).items() if k not in _OURS and not k.startswith(NODE_PREFIX)
    }


def in_trash(root: Path, step: int, attempt: str) -> dict[str, str]:
    """The files of attempt ``attempt``'s set-aside ``tmp_step_N`` directories."""
    trash = root / TRASH
    prefix = f"tmp_step_{step}.attempt-{attempt}-"
    files: dict[str, str] = {}
    if trash.is_dir():
        for entry in sorted(os.listdir(trash)):
            if entry.startswith(prefix):
                files.update(digests(trash / entry))
    return files


def ended_cleanly(
    checks: Checks, daemon: FaultDaemon, steps: Iterable[int], *, internal: int = 0
) -> None:
    """Checks on a daemon run that has ended (every event read).

    Each of ``steps`` has exactly one ``checkpoint.promoted``; the daemon logged no
    ``daemon.internal_error`` but the ``internal`` ones a standing finding accounts for,
    and printed nothing that is not a JSON event.
    """
    counts = Counter(e.get("step") for e in daemon.of("checkpoint.promoted"))
    twice = {s: counts[s] for s in steps if counts[s] != 1}
    checks.expect(not twice, f"steps not promoted exactly once: {twice}")
    errors = daemon.of("daemon.internal_error")
    checks.expect(len(errors) == internal, f"daemon.internal_error: {errors[:3]}")
    checks.expect(not daemon.stdout, f"the daemon printed non-JSON: {daemon.stdout[-5:]}")


def conns_of(daemon: FaultDaemon, pids: Iterable[int]) -> set[int]:
    """The daemon's numbers for every connection these processes opened."""
    wanted = set(pids)
    return {int(e["conn"]) for e in daemon.of("client.connected") if e.get("pid") in wanted}


def whose_tensors(path: Path, step: int, jobs: Iterable[int]) -> list[int | None]:
    """For each rank, the job among ``jobs`` whose tensors ``dcp.load`` finds at ``path``."""
    found: list[int | None] = []
    for rank in (0, 1):
        owner = None
        for number in jobs:
            expected = job_state(rank, step, NUMEL, number)
            loaded = {k: torch.empty_like(v) for k, v in expected.items()}
            try:
                dcp_load(loaded, checkpoint_id=str(path), no_dist=True)
            except Exception:  # not loadable is an answer here: nobody's
                break
            if all(torch.equal(loaded[k], v) for k, v in expected.items()):
                owner = number
                break
        found.append(owner)
    return found


def check_promoted_attempt(
    checks: Checks,
    daemon: FaultDaemon,
    root: Path,
    step: int,
    *,
    job: int,
    files: dict[str, str],
    others: dict[str, dict[str, str]],
    found: frozenset[str] = frozenset(),
) -> str:
    """``step_N`` holds exactly ``files`` (job ``job``'s), none of ``others``'.

    Checks: promoted once (one ``checkpoint.promoted``) as the attempt its manifest
    names; ``ckptd verify``'s check passes; the files but ckptd's own are exactly
    ``files``, by name and SHA-256, and none is byte for byte one of another attempt's;
    ``dcp.load`` gives job ``job``'s tensors on every rank.

    Args:
        checks: Where the results go.
        daemon: The daemon that promoted the step (its events are counted).
        root: The checkpoint root.
        step: The step.
        job: The job whose tensors the step must hold.
        files: The attempt's files: name to SHA-256.
        others: Other attempts' files, by a label for the message.
        found: Files in ``files`` that a standing finding put there: what ``verify``
            says of them is recorded as that finding, not as a violation.

    Returns:
        The attempt the manifest names ("" if there is none).
    """
    path = root / f"step_{step}"
    if not checks.expect((path / MANIFEST_NAME).is_file(), f"step_{step} has no manifest"):
        return ""
    manifest = json.loads((path / MANIFEST_NAME).read_bytes())
    attempt = str(manifest.get("attempt", ""))
    try:  # the reply can come before the harness has read the event from stdout
        daemon.wait_event("checkpoint.promoted", timeout=30, match=is_step(step))
    except AssertionError:
        pass  # counted as none just below
    promoted = [e for e in daemon.of("checkpoint.promoted") if e.get("step") == step]
    checks.expect(
        [e.get("attempt") for e in promoted] == [attempt],
        f"step {step}: checkpoint.promoted {[e.get('attempt') for e in promoted]}, "
        f"manifest names {attempt}",
    )
    problems = verify_checkpoint(str(path))
    known = [p for p in problems if p.split(":")[0] in found]
    checks.finding(not known, f"step_{step} fails verify: {known[:3]}")
    rest = [p for p in problems if p not in known]
    checks.expect(rest == [], f"step_{step} fails verify: {rest[:3]}")
    have = digests(path)
    missing = sorted(files.keys() - have.keys())
    extra = sorted(have.keys() - files.keys())
    differ = sorted(k for k in files.keys() & have.keys() if files[k] != have[k])
    checks.expect(
        not (missing or extra or differ),
        f"step_{step} is not exactly the attempt's files: missing {missing}, extra "
        f"{extra}, other bytes {differ}",
    )
    for label, theirs in others.items():
        mixed = sorted(k for k, v in theirs.items() if have.get(k) == v)
        checks.expect(not mixed, f"step_{step} holds {label}'s {mixed}")
    for rank in (0, 1):
        expected = job_state(rank, step, NUMEL, job)
        loaded = {k: torch.empty_like(v) for k, v in expected.items()}
        try:
            dcp_load(loaded, checkpoint_id=str(path), no_dist=True)
        except Exception as exc:  # any load error is the finding itself
            checks.expect(False, f"step_{step} does not load: {exc!r}"[:400])
            continue
        bad = sorted(k for k, v in expected.items() if not torch.equal(loaded[k], v))
        checks.expect(not bad, f"step_{step} rank {rank}: not job {job}'s tensors: {bad}")
    return attempt
