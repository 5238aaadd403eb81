"""What the protocol fuzzer sends: hypothesis strategies for frames, and the reply oracle.

A frame is bytes sent as they are: a well-formed request with wrong fields (every op the
daemon knows, read from ``orchestrator.protocol``'s own types; each field valid, of the
wrong type, out of range, or missing), an arbitrary JSON value, random bytes with and
without a newline, a line at or beyond the 1 MiB bound, or a hand-picked nasty line.
Valid values name the fuzzer's own root with small steps, ranks and world sizes, never
another job's root. :func:`expected_replies` says how many replies the daemon owes.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import strategies as st

from orchestrator import protocol as p

__all__ = ["CODES", "OPS", "Batch", "batches", "expected_replies", "frames", "ids_in"]

OPS: dict[str, list[str]] = {
    cls.__struct_config__.tag: [f.name for f in msgspec.structs.fields(cls) if f.name != "id"]
    for cls in typing.get_args(p.Request)
}
"""Every op the daemon knows, with its fields (read from the protocol's own types)."""

CODES = frozenset(c.value for c in p.ErrorCode)
I64 = 2**63 - 1
_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _ints(lo: int, hi: int) -> st.SearchStrategy[Any]:
    """Integers just outside ``lo..hi``, far outside, and things that are not integers."""
    return st.one_of(
        st.sampled_from([lo - 1, hi + 1, -(2**64), 2**64, 2**63, -(2**63), 10**30]),
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(lo, hi).map(float),  # 3.0 is not an integer on this wire
        st.integers(lo, hi).map(str),
        _JUNK,
    )


def _field_values(fuzz_root: str) -> dict[str, tuple[st.SearchStrategy[Any], ...]]:
    """Per field: (valid values, wrong values)."""
    paths_ok = st.text(
        st.characters(codec="ascii", exclude_characters="\0/."), min_size=1, max_size=12
    )
    bad_paths = st.one_of(
        st.sampled_from(["..", "../x", "a/../../b", "/etc/passwd", ".", "", "a\0b", "./"]),
        st.just("p" * 4097),
        paths_ok.map(lambda s: f"/{s}"),
        paths_ok.map(lambda s: f"{s}/../../{s}"),
        _JUNK,
    )
    entry_ok = st.fixed_dictionaries({"path": paths_ok, "size": st.integers(0, 100)})
    entry_bad = st.one_of(
        st.fixed_dictionaries({"path": bad_paths, "size": st.integers(0, 100)}),
        st.fixed_dictionaries({"path": paths_ok, "size": _ints(0, I64)}),
        st.fixed_dictionaries({"path": paths_ok, "size": st.just(1), "extra": _JUNK}),
        st.fixed_dictionaries({"size": st.just(1)}),
        _JUNK,
    )
    huge = st.integers(1_000, 45_000).map(
        lambda n: [{"path": f"f{i}", "size": 1} for i in range(n)]
    )
    bad_roots = st.one_of(
        st.sampled_from(["/", "/etc", "/tmp", "relative/run", "", "/nonexistent/root"]),
        st.just(fuzz_root + "/"),
        st.just(fuzz_root + "/../" + os.path.basename(fuzz_root)),
        st.just(fuzz_root + "/./"),
        st.just(fuzz_root + "\0"),
        st.just("/" + "r" * 4096),
        st.text(max_size=30),
        _JUNK,
    )
    return {
        "root": (st.just(fuzz_root), bad_roots),
        "step": (st.integers(0, 31), _ints(0, I64)),
        "rank": (st.integers(0, 7), _ints(0, 2**31 - 1)),
        "world_size": (st.integers(1, 8), _ints(1, 2**31)),
        "files": (
            st.lists(entry_ok, max_size=4),
            st.one_of(
                st.lists(st.one_of(entry_ok, entry_bad), min_size=1, max_size=4), huge, _JUNK
            ),
        ),
        "reason": (st.text(max_size=60), st.one_of(st.just("r" * 4097), _JUNK)),
        "timeout": (
            st.floats(0, 0.2),
            st.one_of(st.sampled_from([-1, -1e-9, 604801, 1e308]), st.text(max_size=5)),
        ),
        "remove": (st.booleans(), st.one_of(st.sampled_from([0, 1, "yes", None]), st.text())),
    }


def _mostly(common: str, rare: list[str], weight: int) -> st.SearchStrategy[str]:
    """``common`` about ``weight`` times as often as each of ``rare``.

    The rare choices sit in the middle: hypothesis favours the ends of a range.
    """
    half = [common] * (weight // 2)
    return st.sampled_from(half + rare + half)


def _rarely() -> st.SearchStrategy[bool]:
    """True about once in a hundred draws."""
    return _mostly("no", ["yes"], 100).map(lambda s: s == "yes")


@st.composite
def _request(draw: st.DrawFn, fields: dict[str, tuple[st.SearchStrategy[Any], ...]]) -> bytes:
    """A request object whose op is known (mostly) and whose fields may each be wrong."""
    kind = draw(_mostly("known", ["text", "junk"], 8))
    op = draw(
        {"known": st.sampled_from(sorted(OPS)), "text": st.text(max_size=12)}.get(kind, _JUNK)
    )
    obj: dict[str, Any] = {"op": op}
    mode = draw(_mostly("valid", ["wrong", "missing"], 8))
    if mode == "valid":
        obj["id"] = draw(st.integers(-I64, I64))
    elif mode == "wrong":
        obj["id"] = draw(_ints(-I64, I64))
    for name in OPS.get(op, []) if isinstance(op, str) else []:
        valid, wrong = fields.get(name, (_JUNK, _JUNK))
        mode = draw(_mostly("valid", ["wrong", "wrong", "missing"], 8))
        if mode != "missing":
            obj[name] = draw(valid if mode == "valid" else wrong)
    if draw(st.integers(0, 9)) == 0:
        obj[draw(st.text(max_size=8))] = draw(_JUNK)
    items = list(obj.items())
    if draw(st.booleans()):
        items.reverse()
    text = json.dumps(dict(items), ensure_ascii=draw(st.booleans()))
    return text.encode() + b"\n"


_NASTY = [
    b'{"op":"ping","id":1,"x":"\xff\xfe"}\n',
    b'{"op":"\\ud800","id":2}\n',
    b'{"op":"ping","id":"\\udfff"}\n',
    b'\xef\xbb\xbf{"op":"ping","id":3}\n',
    b'{"op":"ping","id":4}\r\n',
    b'{"op":"ping","id":5,"op":"begin"}\n',
    b'{"op":"ping","id":1e400}\n',
    b'{"op":"ping","id":-0}\n',
    b'{"op":"ping","id":1.0}\n',
    b"null\n",
    b"[]\n",
    b'"ping"\n',
    b"{}\n",
    b"{\n",
    b'{"op":"ping","id":6}{"op":"ping","id":7}\n',
    b"\x00\x00\x00\n",
]


def _nasty() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.sampled_from(_NASTY),
        st.integers(2, 200_000).map(lambda n: b"[" * n + b"\n"),
        st.integers(2, 50_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n + b"\n"),
        st.integers(20, 10_000).map(lambda n: b'{"op":"ping","id":' + b"9" * n + b"}\n"),
    )


def _over_long() -> st.SearchStrategy[bytes]:
    """Lines at and beyond the 1 MiB bound; some are valid requests but for their size."""
    head = b'{"op":"ping","id":8,"pad":"'

    def line(n: int, valid: bool) -> bytes:
        body = head + b"x" * max(0, n - len(head) - 2) + b'"}' if valid else b"z" * n
        return body + b"\n"

    sizes = st.one_of(st.integers(p.MAX_LINE - 2, p.MAX_LINE + 2), st.integers(p.MAX_LINE, 3 << 20))
    return st.builds(line, sizes, st.booleans())


def _json_values() -> st.SearchStrategy[bytes]:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20)
    )
    values = st.recursive(
        scalars,
        lambda c: st.one_of(
            st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)
        ),
        max_leaves=12,
    )
    return values.map(lambda v: json.dumps(v).encode() + b"\n")


def frames(fuzz_root: str) -> st.SearchStrategy[bytes]:
    """One frame: bytes sent as they are (most, not all, end in a newline)."""
    return st.one_of(
        _request(_field_values(fuzz_root)),
        _request(_field_values(fuzz_root)),
        _request(_field_values(fuzz_root)),
        _json_values(),
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")),
        _nasty(),
        st.sampled_from([b"\n", b"   \n", b"\t\r\n", b"\x0b\x0c\n"]),
        _rarely().flatmap(lambda long: _over_long() if long else st.just(b"\n")),
    )


@dataclass(frozen=True, slots=True)
class Batch:
    """Frames for one connection; ``hang_up`` closes it after sending half a line."""

    conn: int
    frames: list[bytes]
    hang_up: bool


def batches(fuzz_root: str, connections: int) -> st.SearchStrategy[Batch]:
    """What one hypothesis example sends."""
    return st.builds(
        Batch,
        st.integers(0, connections - 1),
        st.lists(frames(fuzz_root), min_size=1, max_size=20),
        _mostly("keep", ["hang up"], 50).map(lambda s: s == "hang up"),
    )


def expected_replies(data: bytes) -> int:
    """Replies the daemon owes for ``data``, by the framing rules of docs/protocol.md.

    One per complete line that is not blank; a line over the bound counts too (it gets
    ``line_too_long``); bytes after the last newline get nothing.
    """
    return sum(1 for seg in data.split(b"\n")[:-1] if len(seg) + 1 > p.MAX_LINE or seg.strip())


def ids_in(frame: bytes) -> set[int]:
    """The request id a frame carries, if it is one JSON object with an integer id."""
    if len(frame) > p.MAX_LINE:
        return set()
    try:
        obj = json.loads(frame)
    except (ValueError, RecursionError):  # not JSON, too deep, or too many digits
        return set()
    rid = obj.get("id") if isinstance(obj, dict) else None
    return {rid} if isinstance(rid, int) and not isinstance(rid, bool) else set()
