"""CI sample of the attempt faults: steps saved again after a death, a lost journal, a freeze.

The same scenarios as the long run with small numbers: each attempt scenario once and a
short rescue race. The findings that stand are strict xfails (docs/reliability.md,
Findings): they raise :class:`FindingStands`, so any other failure of the same test still
fails it.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from tests.conftest import LineClient
from tests.faults._attempt_common import NUMEL, PRE_BEGIN, serving, wait_settled
from tests.faults._attempt_worker import job_state
from tests.faults.attempts import SCENARIOS
from tests.faults.race import rescue_race


class FindingStands(Exception):
    """Raised when a scenario shows a finding of docs/reliability.md that is not fixed."""


FINDINGS: dict[str, str] = {}
"""Scenarios that show a standing finding (docs/reliability.md, Findings)."""

SAMPLE = [
    pytest.param(
        name,
        marks=pytest.mark.xfail(
            strict=True,
            raises=FindingStands,
            reason=f"{FINDINGS[name]} (docs/reliability.md, Findings)",
        ),
    )
    if name in FINDINGS
    else name
    for name in sorted(SCENARIOS)
]


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestAttemptScenarios:
    """A step saved again holds one attempt's files only (docs/guarantees.md, 4a)."""

    @pytest.mark.parametrize("name", SAMPLE)
    def test_scenario(self, short_dir: Path, name: str) -> None:
        outcome = SCENARIOS[name](short_dir)
        assert outcome.violations == [], outcome.observed
        if outcome.evidence.get("findings"):
            raise FindingStands(outcome.observed)

    def test_rescue_race(self, short_dir: Path) -> None:
        outcome = rescue_race(short_dir, trials=8, seed=20261201)
        assert outcome.violations == [], outcome.observed
        assert len(outcome.evidence["trials"]) == 8


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestRescueFromTheTrash:
    """A rescue promotes the set-aside directory where it lies, never through ``tmp_step_N``."""

    def test_a_new_jobs_pre_begin_file_stays_out_of_the_rescued_step(self, short_dir: Path) -> None:
        with serving(short_dir) as (daemon, root):
            with LineClient(daemon.socket_path) as client:
                # A one-rank trainer writes step 1 with a real DCP save, then fails.
                begun = client.request("begin", root=str(root), step=1, rank=0, world_size=1)
                state = job_state(0, 1, NUMEL, 1)
                dcp_save(state, checkpoint_id=begun["path"], no_dist=True)
                client.request("fail", root=str(root), step=1, rank=0, reason="after writing")
                settled = wait_settled(daemon, root, 1)
                assert settled.get("state") == "failed", settled
            # A resumed NeMo-RL trainer saving step 1 again writes training_info.json into
            # tmp_step_1 before it begins, while an operator rescues the failed attempt.
            trainer = threading.Thread(target=_pre_begin_write, args=(root,))
            trainer.start()
            try:
                rescue = daemon.request("promote", root=str(root), step=1, timeout=60)
            finally:
                trainer.join(90)
            with LineClient(daemon.socket_path) as client:  # the trainer's begin, refused
                late = client.request("begin", root=str(root), step=1, rank=0, world_size=1)
        assert rescue.get("state") == "promoted", rescue
        assert late["ok"] is False and late["error"]["code"] == "already_promoted", late
        assert PRE_BEGIN not in os.listdir(root / "step_1")
        assert (root / "tmp_step_1" / PRE_BEGIN).exists()  # the trainer's, left where it was


@pytest.mark.slow
@pytest.mark.timeout(120)
class TestRescueOfAStepBeingWritten:
    """``ckptd promote`` of a step whose rank is still writing is refused, never an error."""

    def test_refused_while_files_change(self, short_dir: Path) -> None:
        with serving(short_dir) as (daemon, root):
            with LineClient(daemon.socket_path) as rank, LineClient(daemon.socket_path) as op:
                begun = rank.request("begin", root=str(root), step=1, rank=0, world_size=1)
                # DCP's coordinator writes .metadata.tmp and renames it to .metadata; here
                # a thread does so over and over while an operator tries to rescue.
                stop = threading.Event()
                churn = threading.Thread(target=_renames, args=(Path(begun["path"]), stop))
                churn.start()
                codes: list[str] = []
                try:
                    while len(codes) < 5000 and "internal" not in codes:
                        codes.append(_rescue_code(op, root))
                finally:
                    stop.set()
                    churn.join(30)
        assert set(codes) <= {"invalid_state", "unverifiable", "internal"}, codes
        if "internal" in codes:
            raise FindingStands(f"rescue {len(codes)} answered internal")


def _rescue_code(client: LineClient, root: Path) -> str:
    reply = client.request("promote", root=str(root), step=1, timeout=5)
    return str(reply["error"]["code"]) if not reply["ok"] else str(reply["state"])


def _renames(directory: Path, stop: threading.Event) -> None:
    """Rename a file back and forth in ``directory`` until ``stop`` is set."""
    staged, final = directory / ".metadata.tmp", directory / ".metadata"
    staged.write_bytes(b"x")
    while not stop.is_set():  # the load of the trial, not a wait for anything
        os.rename(staged, final)
        os.rename(final, staged)


def _pre_begin_write(root: Path) -> None:
    """Write the pre-begin file by path, as a trainer does before its ``begin``."""
    tmp = root / "tmp_step_1"
    tmp.mkdir(exist_ok=True)  # the trainer does not know whether it is there
    (tmp / PRE_BEGIN).write_bytes(b'{"job": 2, "step": 1}')
