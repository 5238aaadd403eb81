"""What a directory holds, to compare before and after something must not touch it."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``directory``, by relative path: size, mtime (ns) and SHA-256."""
    found = {}
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            st = path.stat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            found[str(path.relative_to(directory))] = (st.st_size, st.st_mtime_ns, digest)
    return found
