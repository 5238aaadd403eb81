"""``ckptd`` on uvloop: the unchanged daemon CLI with uvloop's event loop policy installed.

anyio's asyncio backend builds its loop from the current policy, so this runs the very
same ``daemon.cli.main`` on uvloop. The benchmarks use it to measure what uvloop would
buy before anything in ``daemon/`` changes.

    python -m bench._uvloop_serve serve --socket ... --root ...
"""

from __future__ import annotations

import asyncio
import sys

import uvloop

from daemon.cli import main

if __name__ == "__main__":
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    sys.exit(main())
