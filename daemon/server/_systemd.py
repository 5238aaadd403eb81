"""Minimal systemd integration: socket activation, sd_notify and the watchdog.

A stdlib-only re-implementation of the parts of libsystemd that ckptd uses, so the daemon
needs no C bindings. Each function returns an empty result (``[]``, ``None`` or ``False``)
when the process was not started by systemd, so callers need not check for it first.

See sd_listen_fds(3), sd_notify(3) and sd_watchdog_enabled(3).
"""

from __future__ import annotations

import os
import socket
import time

SD_LISTEN_FDS_START = 3
"""The first file descriptor passed by socket activation; the rest follow consecutively."""

_LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# A full notification queue must not stall the event loop for long; systemd drains it fast.
_NOTIFY_TIMEOUT = 1.0


def _parse_int(name: str, value: str) -> int:
    try:
        return int(value, 10)
    except ValueError:
        raise ValueError(f"${name} is not a decimal integer: {value!r}") from None


def listen_fds(*, unset_environment: bool = True) -> list[socket.socket]:
    """Return the sockets passed by systemd socket activation, as sd_listen_fds(3) does.

    The descriptors start at ``SD_LISTEN_FDS_START`` (3); ``$LISTEN_FDS`` gives their
    count. They are only taken when ``$LISTEN_PID`` names this process: variables
    inherited by a child of the activated process are ignored. Each descriptor gets
    ``FD_CLOEXEC`` so that it does not leak into processes the daemon spawns.

    Args:
        unset_environment: Remove ``LISTEN_PID``, ``LISTEN_FDS`` and ``LISTEN_FDNAMES``
            from ``os.environ`` before returning (whatever the outcome), so that child
            processes do not see them.

    Returns:
        The inherited sockets in descriptor order; empty when none were passed to this
        process.

    Raises:
        ValueError: ``$LISTEN_PID`` or ``$LISTEN_FDS`` is malformed.
        OSError: A passed descriptor is closed or is not a socket.
    """
    try:
        pid_text = os.environ.get("LISTEN_PID", "")
        if not pid_text:
            return []
        if _parse_int("LISTEN_PID", pid_text) != os.getpid():
            return []
        fds_text = os.environ.get("LISTEN_FDS", "")
        if not fds_text:
            return []
        count = _parse_int("LISTEN_FDS", fds_text)
        if count < 0:
            raise ValueError(f"$LISTEN_FDS is negative: {count}")
        sockets: list[socket.socket] = []
        try:
            for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count):
                os.set_inheritable(fd, False)  # sets FD_CLOEXEC
                sockets.append(socket.socket(fileno=fd))
        except BaseException:
            # Leave the inherited descriptors open, as libsystemd does: detach, don't close.
            for sock in sockets:
                sock.detach()
            raise
        return sockets
    finally:
        if unset_environment:
            for name in _LISTEN_VARS:
                os.environ.pop(name, None)


def _name(constant: int) -> str:
    # Unknown families and types come back as plain ints rather than enum members.
    return str(getattr(constant, "name", constant))


def listen_unix_socket() -> socket.socket | None:
    """Return the listening Unix stream socket passed by systemd, if any.

    The daemon serves one socket. When systemd passes several, the first is returned
    and the others are closed (in this process only).

    Returns:
        The first inherited socket, or ``None`` when the process was not socket-activated.

    Raises:
        ValueError: An inherited socket is not ``AF_UNIX``/``SOCK_STREAM``, or is not
            listening (for instance a connection socket from ``Accept=yes``). All
            inherited sockets are closed first.
    """
    sockets = listen_fds()
    for index, sock in enumerate(sockets):
        problem = ""
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            kind = f"{_name(sock.family)}/{_name(sock.type)}"
            problem = (
                f"is {kind}; ckptd needs AF_UNIX/SOCK_STREAM "
                "(use ListenStream=/path in the .socket unit)"
            )
        elif not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            problem = "is not listening; the .socket unit must not set Accept=yes"
        if problem:
            for other in sockets:
                other.close()
            fd = SD_LISTEN_FDS_START + index
            raise ValueError(f"socket-activation file descriptor {fd} {problem}")
    for extra in sockets[1:]:
        extra.close()
    return sockets[0] if sockets else None


def _notify_address(value: str) -> str | None:
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # vsock: and other address kinds are not supported


def notify(*states: str) -> bool:
    """Send a state notification to the service manager, as sd_notify(3) does.

    Each state is one ``KEY=VALUE`` assignment, such as ``"READY=1"``; they are sent as a
    single newline-separated datagram to ``$NOTIFY_SOCKET`` (a path, or an abstract
    socket name starting with ``@``). The call never raises: a daemon must keep working
    when the notification cannot be delivered.

    Args:
        *states: The assignments to send.

    Returns:
        ``True`` if the datagram was sent; ``False`` if ``$NOTIFY_SOCKET`` is unset or
        unsupported, no state was given, or sending failed.
    """
    address = _notify_address(os.environ.get("NOTIFY_SOCKET", ""))
    if address is None or not states:
        return False
    try:
        message = "\n".join(states).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(_NOTIFY_TIMEOUT)
            return sock.sendto(message, address) == len(message)
    except (OSError, ValueError):
        return False


def _status(text: str) -> str:
    return "STATUS=" + " ".join(text.splitlines())


def notify_status(text: str) -> bool:
    """Set the status line shown by ``systemctl status`` (newlines become spaces).

    Args:
        text: The status.

    Returns:
        Whether the notification was sent (see :func:`notify`).
    """
    return notify(_status(text))


def notify_ready(status: str = "") -> bool:
    """Tell the service manager that start-up has finished (``READY=1``).

    Args:
        status: An optional status line to send with it.

    Returns:
        Whether the notification was sent (see :func:`notify`).
    """
    return notify("READY=1", _status(status)) if status else notify("READY=1")


def notify_stopping() -> bool:
    """Tell the service manager that shutdown has begun (``STOPPING=1``); see :func:`notify`."""
    return notify("STOPPING=1")


def notify_reloading() -> bool:
    """Tell the service manager a configuration reload has begun (``RELOADING=1``).

    ``MONOTONIC_USEC`` goes with it, as ``Type=notify-reload`` requires; ``READY=1``
    (:func:`notify_ready`) ends the reload.
    """
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    return notify("RELOADING=1", f"MONOTONIC_USEC={usec}", _status("reloading configuration"))


def notify_watchdog() -> bool:
    """Send a watchdog keep-alive ping (``WATCHDOG=1``); see :func:`notify`."""
    return notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Return the watchdog timeout systemd expects pings within, as sd_watchdog_enabled(3).

    Callers should ping with :func:`notify_watchdog` every half of the returned interval.

    Returns:
        The timeout in seconds from ``$WATCHDOG_USEC``, or ``None`` when the watchdog is
        disabled or ``$WATCHDOG_PID`` names another process.

    Raises:
        ValueError: ``$WATCHDOG_USEC`` or ``$WATCHDOG_PID`` is malformed.
    """
    usec_text = os.environ.get("WATCHDOG_USEC", "")
    if not usec_text:
        return None
    pid_text = os.environ.get("WATCHDOG_PID", "")
    if pid_text and _parse_int("WATCHDOG_PID", pid_text) != os.getpid():
        return None
    usec = _parse_int("WATCHDOG_USEC", usec_text)
    if usec <= 0:
        return None
    return usec / 1_000_000
