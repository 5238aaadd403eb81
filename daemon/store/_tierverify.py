"""``ckptd verify --deep``: re-check a step's recorded checksums, on either tier.

A fast-tier step carries its node's part file (``.ckptd-tier/part.json``: every file's
size and SHA-256, computed once when the part was sealed); a step drained to the durable
root carries ``.ckptd-sums/NODE.json`` for each node's part, copied with it. Each file
named there is read in full and hashed again.
"""

from __future__ import annotations

import os

import msgspec

from ._tier import PART, hash_file, read_part

__all__ = ["deep_verify"]

_SUMS = ".ckptd-sums"


def deep_verify(path: str) -> tuple[int, list[str]]:
    """How many files were re-hashed under ``path``, and each problem found.

    A step with no recorded checksums (not saved through a fast tier) is one problem.
    """
    sums: dict[str, tuple[int | None, str]] = {}
    part = read_part(path)
    if part is not None:
        sums = {f.path: (f.size, f.sha256) for f in part.files()}
    else:
        try:
            names = sorted(os.listdir(os.path.join(path, _SUMS)))
        except (FileNotFoundError, NotADirectoryError):
            names = []
        for name in names:
            try:
                with open(os.path.join(path, _SUMS, name), "rb") as f:
                    recorded = msgspec.json.decode(f.read(), type=dict[str, str])
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                return 0, [f"{_SUMS}/{name}: unreadable ({exc})"]
            sums.update({rel: (None, sha) for rel, sha in recorded.items()})
    if not sums:
        why = f"no checksums recorded ({PART} or {_SUMS}/): --deep checks fast-tier steps"
        return 0, [why]
    problems = []
    for rel, (size, sha) in sorted(sums.items()):
        try:
            got_size, got = hash_file(os.path.join(path, rel))
        except OSError as exc:
            problems.append(f"{rel}: {exc.strerror or exc}")
            continue
        if size is not None and got_size != size:
            problems.append(f"{rel}: {got_size} bytes, {size} recorded")
        elif got != sha:
            problems.append(
                f"{rel}: SHA-256 {got[:16]}... does not match the recorded {sha[:16]}..."
            )
    return len(sums), problems
