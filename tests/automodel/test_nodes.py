"""``AutomodelCheckpointManager(local_world_size=...)``: the node's ranks, in every begin."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from orchestrator import CheckpointClient
from tests._peer import ScriptedDaemon
from tests.automodel.conftest import RankJob

if TYPE_CHECKING:
    from orchestrator.automodel import AutomodelCheckpointManager


@pytest.fixture(scope="module", autouse=True)
def _imported() -> None:
    """Import nemo_automodel when these tests run, not as every worker collects them."""
    global AutomodelCheckpointManager
    from orchestrator.automodel import AutomodelCheckpointManager


class TestChecked:
    """With a daemon, a count that cannot be right fails ``init_checkpointer`` first.

    (Without one the count is never used, and the world size is not read: NeMo-RL's
    tests call ``init_checkpointer`` with ``torch.distributed`` mocked.)
    """

    @pytest.fixture
    def client(self, short_dir: Path) -> Iterator[CheckpointClient]:
        client = CheckpointClient(str(short_dir / "none.sock"))
        yield client
        client.close(timeout=0)

    @pytest.mark.parametrize("bad", [2, 0, True])
    def test_argument(self, bad: int, client: CheckpointClient) -> None:
        manager = AutomodelCheckpointManager(
            None,  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            local_world_size=bad,
            use_daemon=True,
            client=client,
        )
        with pytest.raises(ValueError, match="local_world_size"):
            manager.init_checkpointer()
        assert manager.checkpointer is None

    def test_environment(self, monkeypatch: pytest.MonkeyPatch, client: CheckpointClient) -> None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
        manager = AutomodelCheckpointManager(None, None, use_daemon=True, client=client)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='3'"):
            manager.init_checkpointer()
        assert manager.checkpointer is None


@pytest.fixture
def peer(short_dir: Path, root: Path) -> Iterator[ScriptedDaemon]:
    """A scripted daemon that refuses every begin (so nothing is written)."""
    scripted = ScriptedDaemon(short_dir / "peer.sock", root)
    scripted.refusal = ("already_promoted", "step 1 is already promoted")
    yield scripted
    scripted.close()


@pytest.mark.slow
class TestSent:
    """A real 2-rank job (gloo, CPU) whose two ranks are on two nodes."""

    @pytest.mark.parametrize(
        ("env", "args"),
        [({"LOCAL_WORLD_SIZE": "1"}, []), ({"LOCAL_WORLD_SIZE": "2"}, ["--local-world-size", "1"])],
        ids=["from-env", "explicit-wins"],
    )
    def test_each_begin_says_it(
        self,
        peer: ScriptedDaemon,
        short_dir: Path,
        root: Path,
        rank_jobs: Callable[..., RankJob],
        env: dict[str, str],
        args: list[str],
    ) -> None:
        job = rank_jobs(
            "nodes", "--root", str(root), *args, socket_path=short_dir / "peer.sock", env=env
        )
        for rank in (0, 1):
            assert job.wait_line("ready", rank=rank)["uses_daemon"]
            assert job.wait_line("refused", rank=rank)["code"] == "already_promoted"
        assert job.wait() == [0, 0]
        begins = [peer.next_request("begin", step=1, rank=rank) for rank in (0, 1)]
        assert [b["local_world_size"] for b in begins] == [1, 1]
