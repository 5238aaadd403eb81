"""Framing: untrusted lines decoded into typed requests, messages encoded as lines.

A line that is not a valid request raises :class:`ProtocolError` with the error code its
reply carries; only on that path is the line looked at again, to say precisely what is
wrong (bad JSON, no ``op`` or ``id``, an unknown op, or a bad field).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from ._constants import ErrorCode
from ._requests import (
    _I64,
    Begin,
    Done,
    Fail,
    Gc,
    Health,
    Hold,
    Latest,
    Pin,
    Ping,
    Promote,
    Request,
    Restore,
    Retention,
    Score,
    Status,
    Subscribe,
    Unpin,
    Wait,
)

__all__ = ["ProtocolError", "decode_request", "encode"]

_request_decoder: Final = msgspec.json.Decoder(Request)
_envelope_decoder: Final = msgspec.json.Decoder(dict[str, msgspec.Raw])
_encoder: Final = msgspec.json.Encoder()
_OPS: Final = frozenset(
    str(t.__struct_config__.tag)
    for t in (
        Ping,
        Begin,
        Done,
        Fail,
        Wait,
        Status,
        Latest,
        Restore,
        Subscribe,
        Gc,
        Promote,
        Score,
        Pin,
        Unpin,
        Hold,
        Retention,
        Health,
    )
)


class ProtocolError(ValueError):
    """Raised by :func:`decode_request` for a line that is not a valid request.

    Attributes:
        code: The :class:`ErrorCode` for the reply.
        request_id: The request's ``id`` if one could be read, else None.
    """

    def __init__(self, code: ErrorCode, message: str, request_id: int | None) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def decode_request(line: bytes) -> Request:
    """Decode one line into a typed request.

    Args:
        line: One frame, with or without its trailing newline.

    Returns:
        The request.

    Raises:
        ProtocolError: The line is not UTF-8 JSON, not an object with ``op`` and ``id``,
            names an unknown op, or has a missing, mistyped or out-of-range field.
    """
    try:
        # msgspec skips unknown fields without looking at them; the whole line must
        # still be UTF-8, as the protocol says.
        line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"not valid UTF-8: {exc}", None) from None
    try:
        return _request_decoder.decode(line)
    except msgspec.ValidationError as exc:
        raise _classify(line, exc) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"not valid JSON: {exc}", None) from None
    except RecursionError:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "JSON nested too deeply", None) from None


def _classify(line: bytes, exc: msgspec.ValidationError) -> ProtocolError:
    # Only on the error path: look at the envelope to say precisely what is wrong. Field
    # values stay raw, so an unreadable value elsewhere cannot hide the op and id.
    try:  # the typed decoder may have stopped at a type mismatch before a syntax error
        msgspec.json.decode(line)
    except msgspec.ValidationError:  # e.g. a number out of range: valid syntax
        pass
    except msgspec.DecodeError as err:
        return ProtocolError(ErrorCode.BAD_JSON, f"not valid JSON: {err}", None)
    except RecursionError:
        return ProtocolError(ErrorCode.BAD_REQUEST, "JSON nested too deeply", None)
    try:
        raw = _envelope_decoder.decode(line)
    except (msgspec.DecodeError, RecursionError):
        return ProtocolError(ErrorCode.BAD_REQUEST, "a request must be a JSON object", None)
    request_id = _raw_value(raw.get("id"))
    if type(request_id) is not int or not -_I64 <= request_id <= _I64:
        request_id = None
    op = _raw_value(raw.get("op"))
    if not isinstance(op, str):
        return ProtocolError(ErrorCode.BAD_REQUEST, 'a request needs an "op" string', request_id)
    if op not in _OPS:
        known = ", ".join(sorted(_OPS))
        return ProtocolError(
            ErrorCode.UNKNOWN_OP, f"unknown op {op!r}; known ops: {known}", request_id
        )
    if request_id is None:
        return ProtocolError(ErrorCode.BAD_REQUEST, 'a request needs an integer "id"', None)
    return ProtocolError(ErrorCode.INVALID_FIELD, str(exc), request_id)


def _raw_value(raw: msgspec.Raw | None) -> Any:
    if raw is None:
        return None
    try:
        return msgspec.json.decode(raw, type=int | str | float | bool | None)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def encode(message: msgspec.Struct | dict[str, Any]) -> bytes:
    """Encode one message as a JSON line, newline included."""
    buf = _encoder.encode(message)
    return buf + b"\n"
