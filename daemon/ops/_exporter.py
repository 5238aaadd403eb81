"""Where the metrics go: an HTTP endpoint for Prometheus, a node_exporter textfile, or both.

``metrics_listen = "HOST:PORT"`` serves ``/metrics`` from ``prometheus_client``'s HTTP
server, in threads of its own; the sampled gauges are read on the event loop
(:class:`daemon.ops._metrics.Metrics`). ``metrics_textfile = PATH`` writes the same text to
``PATH`` through a temporary file in its directory and a rename, so node_exporter's
textfile collector reads the old file or the new one, never a part: after every change
(at most once a second) and at least every :data:`REFRESH` seconds, so the file's mtime
says the daemon is alive. With neither, no metric is kept at all.
"""

from __future__ import annotations

import os
from typing import Final

import anyio
import anyio.to_thread
from prometheus_client import start_http_server, write_to_textfile

from ..base._errors import ConfigError
from ..base._events import Events
from ..config._config import Config, parse_listen
from ._metrics import Metrics, Observed

__all__ = ["REFRESH", "Exporter"]

REFRESH: Final = 10.0
"""Seconds between textfile writes while nothing changes."""

_MIN_INTERVAL: Final = 1.0
"""Seconds at least between two textfile writes."""

_LAST_WRITE: Final = 2.0
"""Seconds shutdown waits for the last textfile write."""


class Exporter:
    """The metrics of one daemon and where they are exported.

    Args:
        config: ``metrics_listen`` and ``metrics_textfile`` say where.
        daemon: Where the gauges are read from.
        events: Counters are fed from its events; ``metrics.*`` events go to it.
        version: The daemon's version.
    """

    def __init__(self, config: Config, daemon: Observed, events: Events, *, version: str) -> None:
        self._config = config
        self._events = events
        self.metrics = Metrics(daemon, version=version)
        self._server: object | None = None
        self.address: tuple[str, int] | None = None
        """The HTTP endpoint's bound address and port (the port when 0 was asked)."""
        self._textfile_failing = False

    @staticmethod
    def wanted(config: Config) -> bool:
        """Whether ``config`` asks for metrics at all."""
        return bool(config.metrics_listen or config.metrics_textfile)

    def start(self) -> None:
        """Hook the metrics into the running daemon and open the HTTP endpoint.

        Call on the event loop, before recovery (its events are counted too).

        Raises:
            ConfigError: ``metrics_listen`` cannot be bound (in use, no such address).
        """
        self.metrics.bind_loop()
        self._events.observer = self.metrics.observe
        listen = self._config.metrics_listen
        if not listen:
            return
        host, port = parse_listen(listen)
        try:
            server, _thread = start_http_server(port, host, registry=self.metrics.registry)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {listen} (metrics_listen): {exc.strerror or exc}"
            ) from exc
        self._server = server
        bound = server.server_address
        self.address = (str(bound[0]), int(bound[1]))
        self._events.emit("metrics.listening", address=self.address[0], port=self.address[1])

    def close(self) -> None:
        """Stop the HTTP endpoint and the event feed."""
        if self._events.observer == self.metrics.observe:
            self._events.observer = None
        server = self._server
        self._server = None
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]

    async def write_textfile(self) -> None:
        """Keep ``metrics_textfile`` current until cancelled, then write it a last time."""
        path = self._config.metrics_textfile
        if not path:
            return
        try:
            while True:
                await self._write(path)
                await anyio.sleep(_MIN_INTERVAL)
                with anyio.move_on_after(REFRESH - _MIN_INTERVAL):
                    await self.metrics.changed.wait()
                self.metrics.changed = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_LAST_WRITE):
                await self._write(path)

    async def _write(self, path: str) -> None:
        # The gauges are sampled on the loop first: the writer thread then needs no hop.
        try:
            await anyio.to_thread.run_sync(
                write_to_textfile, path, self.metrics.registry, abandon_on_cancel=True
            )
        except OSError as exc:
            if not self._textfile_failing:
                self._textfile_failing = True
                error = exc.strerror or str(exc)
                directory = os.path.dirname(path)
                self._events.emit(
                    "metrics.textfile_failed", "warning", path=path, dir=directory, error=error
                )
            return
        if self._textfile_failing:
            self._textfile_failing = False
            self._events.emit("metrics.textfile_recovered", path=path)


def check_listen(config: Config) -> None:
    """Raise ConfigError if ``metrics_listen`` is malformed (it is validated on load)."""
    if config.metrics_listen:
        try:
            parse_listen(config.metrics_listen)
        except ConfigError:
            raise
