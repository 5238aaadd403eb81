"""What the daemon's parts need of the daemon: small Protocols, so none imports the server.

:class:`daemon.server._server.Daemon` satisfies each of them. A part that runs on behalf of the
daemon (a connection, a promotion, gc, recovery, the attempt directories) is given the
daemon as one of these, which keeps ``_server`` at the top of the import graph: it
imports its parts; they import only what they use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import anyio
import msgspec

from orchestrator import protocol as p

from ..base._events import Events
from ..config._config import Config, RootConfig
from ..ledger._ledger import Effect, Ledger, SaveKey
from ..ledger._records import JournalRecord
from ..store._journal import Journal
from ..store._lanes import Lanes
from ..store._storage import Storage

__all__ = ["Collecting", "Coordinating", "Host", "Recovering", "Serving"]


class _Pauses(Protocol):
    def pause(self, root: RootConfig) -> AbstractContextManager[None]: ...


class _Retains(Protocol):
    def promoted(self, root: RootConfig, key: SaveKey) -> None: ...

    def replay(self, record: JournalRecord) -> bool: ...

    def reconfigured(self) -> None: ...


class Host(Protocol):
    """The state and actions every part of the daemon shares."""

    @property
    def trash(self) -> _Pauses:
        """The background remover (``daemon.store._trash``): paused while a root promotes."""
        ...

    @property
    def retention(self) -> _Retains:
        """Retention (``daemon.retention``): told of promotions, replays its records."""
        ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def events(self) -> Events: ...

    @property
    def config(self) -> Config: ...

    @property
    def lanes(self) -> Lanes: ...

    @property
    def storage(self) -> Storage:
        """Every effect on a root (``daemon.store._storage``): run it in the root's lane."""
        ...

    @property
    def root_locks(self) -> Mapping[str, anyio.Lock]: ...

    @property
    def clock(self) -> Callable[[], float]: ...

    def configured(self, path: str) -> RootConfig:
        """The configured root ``path`` names (raises ``RequestError`` otherwise)."""
        ...

    def commit(self, effects: Sequence[Effect]) -> Awaitable[None]:
        """Make the ledger's changes durable, then carry out ``effects``."""
        ...

    def apply(self, effects: Sequence[Effect]) -> None:
        """Carry out ledger effects."""
        ...


class Serving(Host, Protocol):
    """What a connection needs: the request handlers."""

    def dispatch(self, conn: int, request: p.Request) -> Awaitable[msgspec.Struct]:
        """Answer one request other than ``wait`` and ``subscribe``."""
        ...

    def settled(self, request: p.Wait, root: RootConfig) -> Awaitable[p.WaitReply]:
        """The reply to ``wait``."""
        ...

    def ledger_changed(self) -> bool:
        """Whether the ledger holds changes not yet journaled."""
        ...


class _Trash(_Pauses, Protocol):
    def kick(self, root: RootConfig) -> None: ...


class _Reporting(Protocol):
    def reporting(self, key: SaveKey) -> bool: ...


class Collecting(Host, Protocol):
    """What ``gc`` needs: the trash remover, and the steps it is taking."""

    @property
    def trash(self) -> _Trash: ...

    @property
    def attempt_dirs(self) -> _Reporting: ...

    @property
    def collecting(self) -> set[SaveKey]:
        """Steps gc is removing right now: ``begin`` refuses them."""
        ...


class _Starter(Protocol):
    def start(self, key: SaveKey) -> None: ...


class _SetsAside(Protocol):
    def set_aside(self, key: SaveKey, attempt: str) -> Awaitable[str | None]: ...


class _Verdicts(Protocol):
    def write_verdict(
        self, root: RootConfig, key: SaveKey, attempt: str, reason: str
    ) -> Awaitable[None]: ...


class Recovering(Host, Protocol):
    """What recovery needs: the journal, the promoter, the attempt directories."""

    @property
    def nodes(self) -> _Verdicts: ...

    @property
    def journal(self) -> Journal | None: ...

    @property
    def promoter(self) -> _Starter: ...

    @property
    def attempt_dirs(self) -> _SetsAside: ...

    def journal_snapshot(self) -> list[JournalRecord]:
        """Records rebuilding the current state."""
        ...

    async def finish_orphan(self, root: RootConfig, step: int) -> None:
        """Promote an unknown ``tmp_step_N`` whose node markers say every rank was done."""
        ...


class Coordinating(Host, Protocol):
    """What the coordination of saves that span nodes needs: the attempt directories."""

    @property
    def attempt_dirs(self) -> _SetsAside: ...
