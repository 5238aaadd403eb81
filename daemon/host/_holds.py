"""Counting the work under way (failures whose report waits, tasks to finish) to wait on."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

import anyio

__all__ = ["Holds"]

K = TypeVar("K", bound=Hashable)


class Holds(Generic[K]):
    """Work under way per key (a save's failures, a background task), with a wait for none.

    Each :meth:`hold` is matched by one :meth:`release`; :meth:`idle` returns once
    nothing is held (shutdown waits: each one journals its outcome).
    """

    def __init__(self) -> None:
        self._count: dict[K, int] = {}
        self._none: anyio.Event | None = None  # waited on by idle()

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def __bool__(self) -> bool:
        return bool(self._count)

    def __iter__(self) -> Iterator[K]:
        """The keys held now (a copy: holding or releasing meanwhile is safe)."""
        return iter(list(self._count))

    def hold(self, key: K) -> None:
        """One more piece of work of ``key`` is under way."""
        self._count[key] = self._count.get(key, 0) + 1

    def release(self, key: K) -> None:
        """One piece of work of ``key`` is done."""
        left = self._count[key] - 1
        if left:
            self._count[key] = left
            return
        del self._count[key]
        if not self._count and self._none is not None:
            self._none.set()
            self._none = None

    async def idle(self) -> None:
        """Return once nothing is held."""
        while self._count:
            if self._none is None:
                self._none = anyio.Event()
            await self._none.wait()
