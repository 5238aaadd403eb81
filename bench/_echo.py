"""The throughput baseline: a bare asyncio newline-JSON echo server on a Unix socket.

For every line it decodes the JSON request and answers ``{"id": ..., "ok": true}``: the
daemon's request path without validation, ledger, journal or events. Driven by the same
load generator as the daemon, its rate is the ceiling of the language and the socket on
this machine.

    python -m bench._echo SOCKET [--uvloop] [--stdlib-json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec


def _codec(stdlib: bool) -> tuple[Callable[[bytes], Any], Callable[[Any], bytes]]:
    if stdlib:
        return json.loads, lambda obj: json.dumps(obj).encode()
    return msgspec.json.decode, msgspec.json.encode


async def serve(path: str, stdlib_json: bool = False) -> None:
    """Answer every line on ``path`` until cancelled."""
    decode, encode = _codec(stdlib_json)

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                request = decode(line)
                writer.write(encode({"id": request.get("id"), "ok": True}) + b"\n")
        except (ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(client, path, backlog=1024)
    sys.stdout.write('{"event": "daemon.ready"}\n')
    sys.stdout.flush()
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket")
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--stdlib-json", action="store_true")
    args = parser.parse_args()
    if os.path.exists(args.socket):
        os.unlink(args.socket)
    if args.uvloop:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        asyncio.run(serve(args.socket, args.stdlib_json))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
