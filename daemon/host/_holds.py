"""Counting the failures whose report waits until their files are dealt with."""

from __future__ import annotations

import anyio

from ..ledger._saves import SaveKey

__all__ = ["Holds"]


class Holds:
    """Failures being carried out per save, whose report waits until they are done."""

    def __init__(self) -> None:
        self._count: dict[SaveKey, int] = {}
        self._none: anyio.Event | None = None  # waited on by idle()

    def __contains__(self, key: object) -> bool:
        return key in self._count

    def __bool__(self) -> bool:
        return bool(self._count)

    def hold(self, key: SaveKey) -> None:
        """One more failure of ``key`` is being carried out."""
        self._count[key] = self._count.get(key, 0) + 1

    def release(self, key: SaveKey) -> None:
        """One failure of ``key`` is carried out."""
        left = self._count[key] - 1
        if left:
            self._count[key] = left
            return
        del self._count[key]
        if not self._count and self._none is not None:
            self._none.set()
            self._none = None

    async def idle(self) -> None:
        """Return once nothing is held (shutdown waits: each one journals its outcome)."""
        while self._count:
            if self._none is None:
                self._none = anyio.Event()
            await self._none.wait()
