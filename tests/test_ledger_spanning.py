"""The ledger's rules for saves spanning nodes (pure: no I/O, time passed in)."""

from __future__ import annotations

import pytest

from daemon.base._errors import RequestError
from daemon.ledger._ledger import Ledger, SaveKey, Verify
from daemon.ledger._saves import Emit, MarkNode, NodeFailed, SetAside, Watch
from orchestrator.protocol import FileEntry, SaveState

KEY = SaveKey("/ckpt/run", 7)


def _leader(world: int = 6, lws: int = 2, timeout: float = 10.0) -> Ledger:
    """A leader whose local ranks 0..lws-1 are done and marked."""
    ledger = Ledger(lease=5.0, save_timeout=None, node_timeout=timeout)
    for rank in range(lws):
        ledger.begin(KEY, rank, world, rank + 1, 0.0, fresh="att", local_world_size=lws)
    for rank in range(lws):
        effects = ledger.done(KEY, rank, [FileEntry(f"r{rank}", 1)], rank + 1, 0.0)
    assert any(isinstance(e, MarkNode) for e in effects)
    effects = ledger.node_marked(KEY, 1.0)
    assert any(isinstance(e, Watch) for e in effects)
    return ledger


def _files(*ranks: int) -> dict[int, list[FileEntry]]:
    return {r: [FileEntry(f"r{r}", 1)] for r in ranks}


class TestLocalRanks:
    """A node's begins must agree with each other."""

    def test_a_node_may_not_have_more_ranks_than_it_said(self) -> None:
        ledger = Ledger(lease=5.0, save_timeout=None)
        ledger.begin(KEY, 2, 4, 1, 0.0, fresh="a", local_world_size=2)
        ledger.begin(KEY, 3, 4, 2, 0.0, fresh="a", local_world_size=2)
        with pytest.raises(RequestError, match="rank number 3 on this node"):
            ledger.begin(KEY, 0, 4, 3, 0.0, fresh="a", local_world_size=2)

    def test_local_world_sizes_must_agree(self) -> None:
        ledger = Ledger(lease=5.0, save_timeout=None)
        ledger.begin(KEY, 2, 4, 1, 0.0, fresh="a", local_world_size=2)
        with pytest.raises(RequestError, match="earlier ranks said 2"):
            ledger.begin(KEY, 3, 4, 2, 0.0, fresh="a", local_world_size=1)
        with pytest.raises(RequestError, match="larger than world_size"):
            ledger.begin(KEY, 3, 4, 2, 0.0, fresh="a", local_world_size=5)

    def test_a_save_on_one_node_never_marks(self) -> None:
        ledger = Ledger(lease=5.0, save_timeout=None)
        ledger.begin(KEY, 0, 1, 1, 0.0, fresh="a", local_world_size=1)
        effects = ledger.done(KEY, 0, [], 1, 0.0)
        assert [type(e) for e in effects if not isinstance(e, Emit)] == [Verify]


class TestLeader:
    """The leader verifies once markers of its attempt cover every rank."""

    def test_markers_covering_every_rank_start_verification(self) -> None:
        ledger = _leader()
        assert not any(
            isinstance(e, Verify) for e in ledger.remote_done(KEY, "b", "att", 2, _files(2, 3), 2.0)
        )
        effects = ledger.remote_done(KEY, "c", "att", 2, _files(4, 5), 2.0)
        assert any(isinstance(e, Verify) for e in effects)
        save = ledger.get(KEY)
        assert save is not None and save.state is SaveState.VERIFYING
        assert save.reported_files()[5] == (FileEntry("r5", 1),)

    def test_another_attempts_marker_never_counts(self) -> None:
        ledger = _leader(world=4)
        assert ledger.remote_done(KEY, "b", "zombie", 2, _files(2, 3), 2.0) == []
        save = ledger.get(KEY)
        assert save is not None and save.missing_ranks() == [2, 3]

    @pytest.mark.parametrize(
        ("node_files", "lws", "why"),
        [
            (_files(1, 2), 2, "rank 1 is claimed by node b and by the leader"),
            (_files(6, 7), 2, "outside world_size 6"),
            (_files(2, 3), 3, "said it has 3 ranks but reports 2"),
        ],
    )
    def test_a_contradicting_marker_fails_the_step(
        self, node_files: dict[int, list[FileEntry]], lws: int, why: str
    ) -> None:
        ledger = _leader()
        (failed,) = ledger.remote_done(KEY, "b", "att", lws, node_files, 2.0)
        assert isinstance(failed, NodeFailed) and failed.leader
        assert why in failed.reason

    def test_sizes_that_cannot_add_up_fail_the_step_as_soon_as_said(self) -> None:
        ledger = _leader(world=6)
        assert ledger.remote_writing(KEY, "b", "att", 2, 2.0) == []
        (failed,) = ledger.remote_writing(KEY, "c", "att", 3, 2.0)
        assert isinstance(failed, NodeFailed)
        assert "cannot add up to world_size 6: the leader 2, b 2, c 3" in failed.reason

    def test_a_node_read_again_counts_once_by_what_it_says_last(self) -> None:
        # The leader reads a writing marker again and again, then the node's done marker:
        # each time the node's size replaces what it said before, never adds to it.
        ledger = _leader(world=6)
        for _ in range(3):
            assert ledger.remote_writing(KEY, "b", "att", 2, 2.0) == []
        assert ledger.remote_writing(KEY, "c", "att", 1, 2.0) == []
        assert ledger.remote_writing(KEY, "c", "att", 2, 2.0) == []  # 2 + 2 + 2: fits
        effects = ledger.remote_done(KEY, "b", "att", 2, _files(2, 3), 3.0)
        assert not any(isinstance(e, NodeFailed) for e in effects)
        (failed,) = ledger.remote_writing(KEY, "c", "att", 3, 4.0)  # now 2 + 2 + 3
        assert isinstance(failed, NodeFailed)
        assert "cannot add up to world_size 6: the leader 2, b 2, c 3" in failed.reason

    def test_missing_nodes_past_node_timeout_are_named(self) -> None:
        ledger = _leader(world=6, timeout=10.0)
        ledger.remote_done(KEY, "b", "att", 2, _files(2, 3), 2.0)
        save = ledger.get(KEY)
        assert save is not None
        save.writing_nodes.add("c")
        assert ledger.tick(10.5) == []
        (failed,) = ledger.tick(11.0)
        assert isinstance(failed, NodeFailed)
        assert "ranks 4-5 have no node marker; still writing: c; done: the leader and b" in (
            failed.reason
        )

    def test_a_nodes_failure_marker_fails_the_step(self) -> None:
        ledger = _leader()
        (failed,) = ledger.remote_failed(KEY, "b", "att", "oom", 2.0)
        assert isinstance(failed, NodeFailed) and "node b: oom" in failed.reason


class TestLeaderTimeout:
    """A leader's save that times out says what was outstanding, never an empty rank list."""

    def test_every_rank_done_but_the_leaders_marker_not_durable(self) -> None:
        ledger = Ledger(lease=5.0, save_timeout=30.0, node_timeout=60.0)
        for rank in range(2):
            ledger.begin(KEY, rank, 4, rank + 1, 0.0, fresh="att", local_world_size=2)
        for rank in range(2):
            ledger.done(KEY, rank, [FileEntry(f"r{rank}", 1)], rank + 1, 1.0)
        ledger.remote_done(KEY, "b", "att", 2, _files(2, 3), 2.0)
        save = ledger.get(KEY)
        assert save is not None and save.missing_ranks() == [] and not save.marked
        (failed,) = ledger.tick(30.0)  # its node marker's write never returned
        assert isinstance(failed, NodeFailed) and failed.leader
        assert failed.reason == (
            "timed out after 30.0s; every rank is done, but this node's marker "
            "(the leader's) was not yet durable"
        )

    def test_missing_ranks_are_still_listed(self) -> None:
        ledger = Ledger(lease=5.0, save_timeout=30.0, node_timeout=60.0)
        for rank in range(2):
            ledger.begin(KEY, rank, 4, rank + 1, 0.0, fresh="att", local_world_size=2)
        ledger.done(KEY, 0, [FileEntry("r0", 1)], 1, 1.0)
        (failed,) = ledger.tick(30.0)
        assert isinstance(failed, NodeFailed)
        assert failed.reason == "timed out after 30.0s; ranks not done: 1-3"


class TestOtherNodes:
    """A node that does not lead learns the outcome; it never sets the shared directory aside."""

    def _node(self) -> Ledger:
        ledger = Ledger(lease=5.0, save_timeout=None)
        ledger.begin(KEY, 2, 4, 1, 0.0, fresh="att", local_world_size=2)
        ledger.begin(KEY, 3, 4, 2, 0.0, fresh="att", local_world_size=2)
        return ledger

    def test_a_local_failure_writes_a_marker_not_a_set_aside(self) -> None:
        ledger = self._node()
        effects = ledger.fail(KEY, 2, "oom", 1.0)
        assert not any(isinstance(e, SetAside) for e in effects)
        (failed,) = [e for e in effects if isinstance(e, NodeFailed)]
        assert failed.announce and not failed.leader

    def test_the_outcome_is_learned_once(self) -> None:
        ledger = self._node()
        for rank in (2, 3):
            ledger.done(KEY, rank, [], rank - 1, 0.0)
        ledger.node_marked(KEY, 1.0)
        path = "/ckpt/run/step_7"
        effects = ledger.learned(KEY, "att", promoted=True, detail=path, now=2.0)
        assert any(isinstance(e, Emit) and e.name == "checkpoint.promoted" for e in effects)
        assert ledger.learned(KEY, "att", promoted=False, detail="late", now=3.0) == []
        save = ledger.get(KEY)
        assert save is not None and (save.state, save.path) == (SaveState.PROMOTED, path)

    def test_another_attempts_outcome_changes_nothing(self) -> None:
        ledger = self._node()
        assert ledger.learned(KEY, "old", promoted=True, detail="x", now=1.0) == []
