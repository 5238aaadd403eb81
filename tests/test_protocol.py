"""Tests for orchestrator.protocol: decoding untrusted request lines and encoding replies."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from orchestrator.protocol import (
    Ack,
    Begin,
    BeginReply,
    Done,
    ErrorCode,
    ErrorInfo,
    ErrorReply,
    Fail,
    FileEntry,
    Gc,
    GcReply,
    Latest,
    LatestReply,
    Ping,
    PingReply,
    ProtocolError,
    RankInfo,
    RankState,
    Request,
    SaveInfo,
    SaveState,
    Status,
    StatusReply,
    Subscribe,
    Wait,
    WaitReply,
    decode_request,
    encode,
)

I64 = 2**63 - 1
OPS = ("begin", "done", "fail", "gc", "latest", "ping", "status", "subscribe", "wait")
ROOT = "/ckpt/run-42"


def line(obj: Any) -> bytes:
    """``obj`` as a request line, the way any JSON client would write it."""
    return json.dumps(obj).encode() + b"\n"


def refusal(raw: bytes) -> ProtocolError:
    """The ProtocolError ``decode_request`` raises for ``raw``."""
    with pytest.raises(ProtocolError) as info:
        decode_request(raw)
    return info.value


BEGIN: dict[str, Any] = {
    "op": "begin",
    "id": 3,
    "root": ROOT,
    "step": 7,
    "rank": 1,
    "world_size": 4,
}
DONE: dict[str, Any] = {
    "op": "done",
    "id": 4,
    "root": ROOT,
    "step": 7,
    "rank": 1,
    "files": [{"path": "model/__1_0.distcp", "size": 1024}],
}
FAIL: dict[str, Any] = {"op": "fail", "id": 5, "root": ROOT, "step": 7, "rank": 1, "reason": "oom"}


class TestRoundTrip:
    """Every request type decodes from plain JSON into its typed struct."""

    @pytest.mark.parametrize(
        ("obj", "expected"),
        [
            ({"op": "ping", "id": 1}, Ping(id=1)),
            (BEGIN, Begin(id=3, root=ROOT, step=7, rank=1, world_size=4)),
            (
                DONE,
                Done(
                    id=4,
                    root=ROOT,
                    step=7,
                    rank=1,
                    files=[FileEntry(path="model/__1_0.distcp", size=1024)],
                ),
            ),
            (
                {"op": "done", "id": 4, "root": ROOT, "step": 7, "rank": 0},
                Done(id=4, root=ROOT, step=7, rank=0, files=[]),
            ),
            (FAIL, Fail(id=5, root=ROOT, step=7, rank=1, reason="oom")),
            (
                {"op": "fail", "id": 5, "root": ROOT, "step": 7, "rank": 1, "reason": ""},
                Fail(id=5, root=ROOT, step=7, rank=1, reason=""),
            ),
            (
                {"op": "wait", "id": 6, "root": ROOT, "step": 7, "timeout": 2.5},
                Wait(id=6, root=ROOT, step=7, timeout=2.5),
            ),
            (
                {"op": "wait", "id": 6, "root": ROOT, "step": 7, "timeout": 30},
                Wait(id=6, root=ROOT, step=7, timeout=30.0),
            ),
            (
                {"op": "wait", "id": 6, "root": ROOT, "step": 7},
                Wait(id=6, root=ROOT, step=7, timeout=0.0),
            ),
            ({"op": "status", "id": 7}, Status(id=7, root=None)),
            ({"op": "status", "id": 7, "root": None}, Status(id=7, root=None)),
            ({"op": "status", "id": 7, "root": ROOT}, Status(id=7, root=ROOT)),
            ({"op": "latest", "id": 8, "root": ROOT}, Latest(id=8, root=ROOT)),
            ({"op": "subscribe", "id": 9}, Subscribe(id=9)),
            ({"op": "gc", "id": 10, "root": ROOT}, Gc(id=10, root=ROOT, remove=False)),
            (
                {"op": "gc", "id": 10, "root": ROOT, "remove": True},
                Gc(id=10, root=ROOT, remove=True),
            ),
        ],
        ids=lambda v: v["op"] if isinstance(v, dict) else None,
    )
    def test_decodes_into_the_typed_struct(self, obj: dict[str, Any], expected: Request) -> None:
        request = decode_request(line(obj))
        assert type(request) is type(expected)
        assert request == expected

    def test_every_op_is_covered(self) -> None:
        assert sorted(str(t.__struct_config__.tag) for t in REQUEST_TYPES) == sorted(OPS)

    @pytest.mark.parametrize("rid", [0, -1, 2**31, I64, -I64])
    def test_any_64_bit_id_is_kept(self, rid: int) -> None:
        assert decode_request(line({"op": "ping", "id": rid})) == Ping(id=rid)

    def test_bounds_are_inclusive(self) -> None:
        obj = {**BEGIN, "step": I64, "rank": 2**31 - 1, "world_size": 2**31}
        assert decode_request(line(obj)) == Begin(
            id=3, root=ROOT, step=I64, rank=2**31 - 1, world_size=2**31
        )
        long_root = "/" + "r" * 4095
        assert decode_request(line({"op": "latest", "id": 1, "root": long_root})) == Latest(
            id=1, root=long_root
        )
        reason = "x" * 4096
        assert decode_request(line({**FAIL, "reason": reason})) == Fail(
            id=5, root=ROOT, step=7, rank=1, reason=reason
        )
        week = 7 * 24 * 3600
        assert decode_request(
            line({"op": "wait", "id": 1, "root": ROOT, "step": 0, "timeout": week})
        )
        assert decode_request(line({**DONE, "files": [{"path": "f", "size": I64}]}))

    def test_unknown_request_fields_are_ignored(self) -> None:
        obj = {**BEGIN, "future_field": {"nested": [1, 2.5, None]}, "trace": "abc"}
        assert decode_request(line(obj)) == Begin(id=3, root=ROOT, step=7, rank=1, world_size=4)

    @pytest.mark.parametrize(
        "raw",
        [
            b'{"op":"ping","id":1}',
            b'{"op":"ping","id":1}\n',
            b'{"op":"ping","id":1}\r\n',
            b'  {"id": 1, "op": "ping"}  \n',
            '{"op":"ping","id":1,"note":"h\u00e9 \u2603 \U0001f600"}'.encode(),
        ],
        ids=["bare", "newline", "crlf", "spaces-id-first", "utf8"],
    )
    def test_framing_variants_decode(self, raw: bytes) -> None:
        assert decode_request(raw) == Ping(id=1)


class TestErrorClassification:
    """A bad line maps to the error code the docs promise, with the id when it is readable."""

    @pytest.mark.parametrize(
        "raw",
        [b"", b"nope", b"{", b'{"op": "ping", "id": 1', b"\xff\xfe", b'{"op":"ping","id":1} x'],
        ids=["empty", "word", "open-brace", "unterminated", "not-utf8", "trailing"],
    )
    def test_not_json_is_bad_json(self, raw: bytes) -> None:
        exc = refusal(raw)
        assert exc.code is ErrorCode.BAD_JSON
        assert exc.request_id is None
        assert str(exc).startswith(("not valid JSON", "not valid UTF-8"))

    def test_invalid_utf8_in_a_field_is_bad_json(self) -> None:
        exc = refusal(b'{"op": "latest", "id": 1, "root": "/ckpt/\xff"}')
        assert exc.code is ErrorCode.BAD_JSON
        assert exc.request_id is None

    @pytest.mark.parametrize("obj", [[], [{"op": "ping", "id": 1}], "ping", 1, 1.5, None, True])
    def test_json_that_is_not_an_object_is_bad_request(self, obj: Any) -> None:
        exc = refusal(line(obj))
        assert exc.code is ErrorCode.BAD_REQUEST
        assert exc.request_id is None
        assert "object" in str(exc)

    @pytest.mark.parametrize("op", [None, 5, True, [], {}, ["ping"]])
    def test_op_that_is_not_a_string_is_bad_request(self, op: Any) -> None:
        exc = refusal(line({"op": op, "id": 12}))
        assert exc.code is ErrorCode.BAD_REQUEST
        assert exc.request_id == 12, "a readable id is echoed even without an op"
        assert '"op"' in str(exc)

    def test_missing_op_is_bad_request_with_the_id(self) -> None:
        exc = refusal(line({"id": 12, "root": ROOT}))
        assert (exc.code, exc.request_id) == (ErrorCode.BAD_REQUEST, 12)

    @pytest.mark.parametrize("op", ["frobnicate", "", "PING", "Ping", " ping", "_Request", "op"])
    def test_unknown_op_keeps_the_request_id(self, op: str) -> None:
        exc = refusal(line({"op": op, "id": 42, "root": ROOT}))
        assert exc.code is ErrorCode.UNKNOWN_OP
        assert exc.request_id == 42
        assert repr(op) in str(exc)
        assert all(known in str(exc) for known in OPS), "the message lists the known ops"

    def test_unknown_op_without_an_id(self) -> None:
        exc = refusal(line({"op": "frobnicate"}))
        assert (exc.code, exc.request_id) == (ErrorCode.UNKNOWN_OP, None)

    @pytest.mark.parametrize(
        "rid",
        [None, "1", 1.0, 1.5, True, False, [1], {"n": 1}, I64 + 1, -I64 - 1, 10**30],
        ids=repr,
    )
    def test_id_that_is_not_a_64_bit_int_is_bad_request(self, rid: Any) -> None:
        exc = refusal(line({"op": "ping", "id": rid}))
        assert (exc.code, exc.request_id) == (ErrorCode.BAD_REQUEST, None)
        assert '"id"' in str(exc)

    def test_missing_id_is_bad_request(self) -> None:
        exc = refusal(line({"op": "ping"}))
        assert (exc.code, exc.request_id) == (ErrorCode.BAD_REQUEST, None)
        without_id = {k: v for k, v in BEGIN.items() if k != "id"}
        exc = refusal(line(without_id))
        assert (exc.code, exc.request_id) == (ErrorCode.BAD_REQUEST, None)

    def test_missing_id_wins_over_a_bad_field(self) -> None:
        exc = refusal(line({"op": "begin", "root": ROOT, "step": -1}))
        assert (exc.code, exc.request_id) == (ErrorCode.BAD_REQUEST, None)

    @pytest.mark.parametrize(
        ("obj", "field"),
        [
            ({**BEGIN, "step": -1}, "step"),
            ({**BEGIN, "step": I64 + 1}, "step"),
            ({**BEGIN, "step": 1.5}, "step"),
            ({**BEGIN, "step": 7.0}, "step"),
            ({**BEGIN, "step": True}, "step"),
            ({**BEGIN, "step": "7"}, "step"),
            ({**BEGIN, "step": None}, "step"),
            ({**BEGIN, "world_size": 0}, "world_size"),
            ({**BEGIN, "world_size": -4}, "world_size"),
            ({**BEGIN, "world_size": 2**31 + 1}, "world_size"),
            ({**BEGIN, "world_size": False}, "world_size"),
            ({**BEGIN, "rank": "1"}, "rank"),
            ({**BEGIN, "rank": -1}, "rank"),
            ({**BEGIN, "rank": 2**31}, "rank"),
            ({**BEGIN, "rank": 1.0}, "rank"),
            ({**BEGIN, "root": ""}, "root"),
            ({**BEGIN, "root": 5}, "root"),
            ({**BEGIN, "root": "/" + "r" * 4096}, "root"),
            ({k: v for k, v in BEGIN.items() if k != "world_size"}, "world_size"),
            ({k: v for k, v in BEGIN.items() if k != "root"}, "root"),
            ({k: v for k, v in DONE.items() if k != "rank"}, "rank"),
            ({**DONE, "files": [{"path": "model/x"}]}, "size"),
            ({**DONE, "files": [{"size": 1}]}, "path"),
            ({**DONE, "files": [{"path": "x", "size": -1}]}, "size"),
            ({**DONE, "files": [{"path": "x", "size": True}]}, "size"),
            ({**DONE, "files": [{"path": "x", "size": 1.5}]}, "size"),
            ({**DONE, "files": [{"path": "", "size": 1}]}, "path"),
            ({**DONE, "files": [{"path": "x", "size": 1, "mode": 420}]}, "mode"),
            ({**DONE, "files": {"path": "x", "size": 1}}, "files"),
            ({**DONE, "files": None}, "files"),
            ({**DONE, "files": ["x"]}, "files"),
            ({**FAIL, "reason": None}, "reason"),
            ({**FAIL, "reason": "x" * 4097}, "reason"),
            ({k: v for k, v in FAIL.items() if k != "reason"}, "reason"),
            ({"op": "wait", "id": 1, "root": ROOT, "step": 1, "timeout": -0.5}, "timeout"),
            ({"op": "wait", "id": 1, "root": ROOT, "step": 1, "timeout": 7 * 86400 + 1}, "timeout"),
            ({"op": "wait", "id": 1, "root": ROOT, "step": 1, "timeout": "5"}, "timeout"),
            ({"op": "status", "id": 1, "root": ""}, "root"),
            ({"op": "latest", "id": 1}, "root"),
            ({"op": "gc", "id": 1, "root": ROOT, "remove": 1}, "remove"),
            ({"op": "gc", "id": 1, "root": ROOT, "remove": "yes"}, "remove"),
        ],
        ids=lambda v: None if isinstance(v, dict) else v,
    )
    def test_bad_field_is_invalid_field_naming_it(self, obj: dict[str, Any], field: str) -> None:
        exc = refusal(line(obj))
        assert exc.code is ErrorCode.INVALID_FIELD
        assert exc.request_id == obj["id"]
        # msgspec's wording: "missing required field `f`" or "... - at `$.f[0].g`".
        assert re.search(rf"`{field}`|\.{field}[`\[]", str(exc)), str(exc)

    def test_too_many_files_is_invalid_field(self) -> None:
        files = [{"path": "f", "size": 0}] * 100_001
        exc = refusal(line({**DONE, "files": files}))
        assert (exc.code, exc.request_id) == (ErrorCode.INVALID_FIELD, 4)
        assert "files" in str(exc)

    def test_protocol_error_is_a_value_error(self) -> None:
        assert isinstance(refusal(b"nope"), ValueError)


DEEP = b"[" * 100_000 + b"]" * 100_000


class TestWholeLineClassification:
    """A line the typed decoder stops on early is still judged by all of its bytes."""

    @pytest.mark.parametrize(
        ("raw", "code", "request_id"),
        [
            (b'["\xff"]', ErrorCode.BAD_JSON, None),
            (b'{"op": "ping", "id": "x", "note": "\xff"}', ErrorCode.BAD_JSON, None),
            (b'{"op": "ping", "id": 1, "note": "\xff"}', ErrorCode.BAD_JSON, None),
            (b'{"op": "ping", "id": 1, "note": "\xc3"}', ErrorCode.BAD_JSON, None),
            (b'{"op": "ping", "id": 1, "note": "\xed\xa0\x80"}', ErrorCode.BAD_JSON, None),
            (b"[1e400]", ErrorCode.BAD_REQUEST, None),
            (b'{"op": "ping", "id": 1e400}', ErrorCode.BAD_REQUEST, None),
            (b'{"id": 1e400, "op": "nope"}', ErrorCode.UNKNOWN_OP, None),
            (b'{"op": "nope", "id": 3, "x": 1e400}', ErrorCode.UNKNOWN_OP, 3),
            (
                b'{"op": "begin", "id": 3, "root": "/", "step": 1e400, "rank": 0, "world_size": 1}',
                ErrorCode.INVALID_FIELD,
                3,
            ),
            (DEEP, ErrorCode.BAD_REQUEST, None),
            (b'{"op": "ping", "id": 1, "x": ' + DEEP + b"}", ErrorCode.BAD_REQUEST, None),
            (b'{"op": "nope", "id": 1, "x": ' + DEEP + b"}", ErrorCode.BAD_REQUEST, None),
        ],
        ids=[
            "bad-utf8-in-array",
            "bad-utf8-after-bad-id",
            "bad-utf8-in-ignored-field",
            "truncated-utf8-in-ignored-field",
            "utf8-surrogate-in-ignored-field",
            "huge-float-in-array",
            "huge-float-id",
            "huge-float-id-unknown-op",
            "huge-float-ignored-unknown-op",
            "huge-float-step",
            "deep-array",
            "deep-ignored-field",
            "deep-field-unknown-op",
        ],
    )
    def test_classified(self, raw: bytes, code: ErrorCode, request_id: int | None) -> None:
        exc = refusal(raw)
        assert (exc.code, exc.request_id) == (code, request_id), str(exc)

    @pytest.mark.parametrize(
        "raw",
        [
            b"[1,",
            b'{"op": 5,',
            b'{"op": "ping", "id": 1.5, ',
            b'{"op": "begin", "id": 1, "root": "/r", "step": -1, "rank": 0, "world_s',
            b"[1] 2",
            b'{"op": "ping"} trailing',
            b'{"op": "nope", "id": 1, "x": [',
            b'["\\ud800"]',
        ],
        ids=[
            "truncated-array",
            "truncated-after-bad-op",
            "truncated-after-bad-id",
            "truncated-after-bad-field",
            "trailing-after-array",
            "trailing-after-missing-id",
            "truncated-after-unknown-op",
            "lone-surrogate-escape",
        ],
    )
    def test_malformed_json_after_a_type_mismatch_is_bad_json(self, raw: bytes) -> None:
        # Without the mismatch the same syntax errors are bad_json (TestErrorClassification).
        assert refusal(raw).code is ErrorCode.BAD_JSON


class TestEncode:
    """Replies encode as one JSON line with ``ok`` always and ``error`` only on failure."""

    def test_ack_bytes(self) -> None:
        assert encode(Ack(id=1)) == b'{"id":1,"ok":true}\n'

    def test_error_reply_bytes(self) -> None:
        reply = ErrorReply(id=10, error=ErrorInfo(code=ErrorCode.RANK_OUT_OF_RANGE, message="no"))
        assert encode(reply) == (
            b'{"id":10,"ok":false,"error":{"code":"rank_out_of_range","message":"no"}}\n'
        )

    def test_error_reply_without_id_bytes(self) -> None:
        reply = ErrorReply(id=None, error=ErrorInfo(code="bad_json", message="not valid JSON"))
        assert encode(reply) == (
            b'{"id":null,"ok":false,"error":{"code":"bad_json","message":"not valid JSON"}}\n'
        )

    def test_ping_reply_bytes(self) -> None:
        assert encode(PingReply(id=2, version="0.1.0")) == (
            b'{"id":2,"ok":true,"version":"0.1.0","protocol":1}\n'
        )

    @pytest.mark.parametrize(
        "reply",
        [
            Ack(id=1),
            PingReply(id=1, version="1"),
            BeginReply(id=1, path=f"{ROOT}/tmp_step_7", state=SaveState.OPEN),
            WaitReply(id=1, state="pending"),
            WaitReply(id=1, state="promoted", path=f"{ROOT}/step_7"),
            WaitReply(id=1, state="failed", reason="rank 0 failed: oom"),
            StatusReply(
                id=1,
                version="1",
                pid=1,
                uptime_s=1.0,
                roots=[ROOT],
                saves=[
                    SaveInfo(
                        root=ROOT,
                        step=7,
                        world_size=1,
                        state=SaveState.OPEN,
                        age_s=0.5,
                        ranks=[RankInfo(rank=0, state=RankState.WRITING, connected=True)],
                    )
                ],
            ),
            LatestReply(id=1, path=f"{ROOT}/step_7", step=7),
            GcReply(id=1, candidates=[], removed=False),
        ],
        ids=lambda r: type(r).__name__,
    )
    def test_success_replies_carry_ok_true_and_no_error(self, reply: msgspec.Struct) -> None:
        raw = encode(reply)
        assert raw.endswith(b"\n") and raw.count(b"\n") == 1
        obj = json.loads(raw)
        assert obj["ok"] is True
        assert obj["id"] == 1
        assert "error" not in obj
        assert list(obj)[:2] == ["id", "ok"], "every reply starts with id and ok"

    def test_error_reply_carries_only_id_ok_and_error(self) -> None:
        obj = json.loads(encode(ErrorReply(id=5, error=ErrorInfo(code="internal", message="x"))))
        assert obj == {"id": 5, "ok": False, "error": {"code": "internal", "message": "x"}}

    def test_newlines_inside_values_stay_escaped(self) -> None:
        raw = encode(ErrorReply(id=1, error=ErrorInfo(code="internal", message="a\nb\r\n")))
        assert raw.count(b"\n") == 1 and raw.endswith(b"\n")
        assert json.loads(raw)["error"]["message"] == "a\nb\r\n"

    def test_dicts_encode_too(self) -> None:
        assert encode({"event": "checkpoint.promoted", "step": 7}) == (
            b'{"event":"checkpoint.promoted","step":7}\n'
        )

    def test_rank_info_omits_defaults(self) -> None:
        raw = encode(RankInfo(rank=3, state=RankState.DONE, connected=False))
        assert raw == b'{"rank":3,"state":"done","connected":false}\n'

    def test_error_codes_are_their_wire_strings(self) -> None:
        assert all(code.value == code.name.lower() for code in ErrorCode)
        assert len({code.value for code in ErrorCode}) == len(ErrorCode)


# -- properties ------------------------------------------------------------------------------

REQUEST_TYPES: tuple[type[msgspec.Struct], ...] = (
    Ping,
    Begin,
    Done,
    Fail,
    Wait,
    Status,
    Latest,
    Subscribe,
    Gc,
)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)
# Objects shaped like requests, so the property reaches past the op and id checks.
field_values = st.one_of(
    json_values,
    st.integers(-2, 8),
    st.sampled_from([ROOT, "", "/", 0, I64, I64 + 1, 2**31]),
    st.lists(
        st.fixed_dictionaries(
            {}, optional={"path": st.sampled_from(["f", "", 1]), "size": json_scalars}
        ),
        max_size=2,
    ),
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "op": st.sampled_from(OPS) | json_values,
        "id": st.integers(-(2**64), 2**64) | json_values,
        "root": field_values,
        "step": field_values,
        "rank": field_values,
        "world_size": field_values,
        "files": field_values,
        "reason": field_values,
        "timeout": field_values,
        "remove": field_values,
    },
)


def check_outcome(raw: bytes, value: Any) -> None:
    """Decoding ``raw`` (the JSON ``value``) returns a Request or raises a fitting ProtocolError."""
    try:
        request = decode_request(raw)
    except ProtocolError as exc:
        assert exc.code is not ErrorCode.BAD_JSON, "the line is valid JSON"
        if not isinstance(value, dict):
            assert (exc.code, exc.request_id) == (ErrorCode.BAD_REQUEST, None)
            return
        rid, op = value.get("id"), value.get("op")
        valid_id = type(rid) is int and -I64 <= rid <= I64
        assert exc.request_id == (rid if valid_id else None)
        if not isinstance(op, str):
            assert exc.code is ErrorCode.BAD_REQUEST
        elif op not in OPS:
            assert exc.code is ErrorCode.UNKNOWN_OP
        elif not valid_id:
            assert exc.code is ErrorCode.BAD_REQUEST
        else:
            assert exc.code is ErrorCode.INVALID_FIELD
    else:
        assert isinstance(request, REQUEST_TYPES)
        assert isinstance(value, dict)
        assert request.id == value["id"]
        assert str(type(request).__struct_config__.tag) == value["op"]


class TestProperties:
    """Whatever arrives, decode_request returns a Request or raises ProtocolError."""

    @settings(max_examples=400, deadline=None)
    @given(value=json_values | request_like, ascii_only=st.booleans())
    def test_any_json_value(self, value: Any, ascii_only: bool) -> None:
        check_outcome(json.dumps(value, ensure_ascii=ascii_only).encode(), value)

    @settings(max_examples=500, deadline=None)
    @given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
    @example(raw=b"[")
    @example(raw=b'{"op": 1,')
    @example(raw=b'{"op": "ping", "id": 1, "x": "\xff"}')
    def test_arbitrary_bytes(self, raw: bytes) -> None:
        try:
            request = decode_request(raw)
        except ProtocolError as exc:
            assert exc.code in (ErrorCode.BAD_JSON, ErrorCode.BAD_REQUEST, ErrorCode.UNKNOWN_OP)
        else:
            assert isinstance(request, REQUEST_TYPES)
            assert json.loads(raw)["op"] == type(request).__struct_config__.tag

    @settings(max_examples=300, deadline=None)
    @given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
    @example(raw=b"[1,")
    def test_bytes_that_are_not_json_are_bad_json(self, raw: bytes) -> None:
        try:
            msgspec.json.decode(raw)
        except msgspec.DecodeError:
            assert refusal(raw).code is ErrorCode.BAD_JSON

    @settings(max_examples=300, deadline=None)
    @given(request=st.deferred(lambda: requests))
    def test_well_formed_requests_round_trip(self, request: Request) -> None:
        assert decode_request(encode(request)) == request
        plain = json.dumps(msgspec.to_builtins(request)).encode()
        assert decode_request(plain) == request


paths = st.text(min_size=1, max_size=40)
steps = st.integers(0, I64)
ranks = st.integers(0, 2**31 - 1)
ids = st.integers(-I64, I64)
requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(Ping, id=ids),
    st.builds(Begin, id=ids, root=paths, step=steps, rank=ranks, world_size=st.integers(1, 2**31)),
    st.builds(
        Done,
        id=ids,
        root=paths,
        step=steps,
        rank=ranks,
        files=st.lists(st.builds(FileEntry, path=paths, size=st.integers(0, I64)), max_size=4),
    ),
    st.builds(Fail, id=ids, root=paths, step=steps, rank=ranks, reason=st.text(max_size=60)),
    st.builds(
        Wait,
        id=ids,
        root=paths,
        step=steps,
        timeout=st.floats(0, 7 * 24 * 3600, allow_nan=False),
    ),
    st.builds(Status, id=ids, root=st.none() | paths),
    st.builds(Latest, id=ids, root=paths),
    st.builds(Subscribe, id=ids),
    st.builds(Gc, id=ids, root=paths, remove=st.booleans()),
)
