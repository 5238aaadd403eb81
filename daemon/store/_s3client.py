"""The few S3 requests the daemon makes, with conditional writes and clear errors.

One :class:`Bucket` per ``s3://`` root, over a botocore client (thread-safe; the root's
lane threads share it). Every call is one request or one paginated series, blocking,
run in the root's lane. A refused condition is :class:`Precondition` (412, or 409 when
the store saw a concurrent conditional write); anything else the store says is
:class:`StoreError`, whose message names the root and what to fix (credentials, the
bucket, the endpoint), never a bare botocore traceback.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import botocore.config
import botocore.exceptions
import botocore.session

from ..config._s3 import S3Options, split_s3_url

__all__ = ["Bucket", "Listed", "Precondition", "StoreError", "Upload"]

DELETE_BATCH: Final = 1000
"""Keys per DeleteObjects request: S3's limit."""

_DENIED: Final = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}
)
_MISSING: Final = frozenset({"NoSuchKey", "404", "NotFound"})
_FULL: Final = frozenset({"QuotaExceeded", "EntityTooLarge", "InsufficientStorage", "507"})


class StoreError(OSError):
    """The store refused or failed a request (credentials, bucket, endpoint, space)."""


class Precondition(StoreError):
    """A conditional write lost: the object exists (``If-None-Match``) or changed (``If-Match``)."""


@dataclass(frozen=True, slots=True)
class Listed:
    """One object a LIST returned."""

    key: str
    size: int
    etag: str
    modified: datetime


@dataclass(frozen=True, slots=True)
class Upload:
    """A multipart upload not yet completed or aborted."""

    key: str
    upload_id: str
    initiated: datetime


class Bucket:
    """The bucket of one ``s3://`` root, and the requests the daemon makes in it.

    Args:
        url: The root, ``s3://BUCKET/PREFIX``.
        options: The root's overrides of the AWS environment.
        env: The environment to read (default ``os.environ``); botocore reads the
            standard variables and files itself.
    """

    def __init__(
        self, url: str, options: S3Options | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.url = url
        self.name, self.prefix = split_s3_url(url)
        opts = options or S3Options()
        env = dict(os.environ) if env is None else env
        session = botocore.session.get_session()
        if opts.profile:
            session.set_config_variable("profile", opts.profile)
        region = opts.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
        config = botocore.config.Config(
            connect_timeout=opts.connect_timeout,
            read_timeout=opts.read_timeout,
            retries={"max_attempts": 3, "mode": "standard"},
            s3={"addressing_style": opts.addressing_style},
            max_pool_connections=32,
            # Only what a request needs: no CRC trailers some stores reject.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        kwargs: dict[str, Any] = {
            "region_name": region or session.get_config_variable("region") or "us-east-1",
            "config": config,
        }
        if opts.endpoint_url:
            kwargs["endpoint_url"] = opts.endpoint_url
        if opts.access_key_id:
            kwargs["aws_access_key_id"] = opts.access_key_id
            kwargs["aws_secret_access_key"] = opts.secret_access_key
        self._client: Any = session.create_client("s3", **kwargs)
        self.endpoint: str = self._client.meta.endpoint_url
        self.requests = 0
        """Requests made so far (a benchmark's count; not locked: approximate)."""

    def key(self, name: str) -> str:
        """The object key of ``name`` (relative to the root's prefix)."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def relative(self, key: str) -> str:
        """``key`` relative to the root's prefix."""
        return key[len(self.prefix) + 1 :] if self.prefix else key

    def check(self) -> None:
        """Check that the bucket exists and the credentials are taken (one HEAD).

        Some stores create a missing bucket on the first PUT into it: a typo in the
        root's URL must fail here instead.

        Raises:
            StoreError: the bucket is missing, access is denied, or the store is down.
        """
        try:
            self._call("head_bucket", ".")
        except FileNotFoundError:
            raise StoreError(
                errno.ENOENT,
                f"bucket {self.name!r} does not exist at {self.endpoint}; create it, or fix "
                "the root's URL or endpoint",
            ) from None

    def get(self, name: str) -> tuple[bytes, str] | None:
        """The bytes and ETag of object ``name``; None if there is none."""
        try:
            reply = self._call("get_object", name, Key=self.key(name))
        except FileNotFoundError:
            return None
        body = reply["Body"]
        try:
            return body.read(), str(reply["ETag"])
        finally:
            body.close()

    def head(self, name: str) -> tuple[int, str] | None:
        """The size and ETag of object ``name``; None if there is none."""
        try:
            reply = self._call("head_object", name, Key=self.key(name))
        except FileNotFoundError:
            return None
        return int(reply["ContentLength"]), str(reply["ETag"])

    def put(self, name: str, data: bytes, *, create: bool = False, match: str | None = None) -> str:
        """Write object ``name``; its new ETag.

        Args:
            name: The object, relative to the root.
            data: Its bytes.
            create: Only if no such object exists (``If-None-Match: *``).
            match: Only if the object's ETag is still this (``If-Match``).

        Raises:
            Precondition: the condition did not hold.
            StoreError: the store refused or failed the write.
        """
        kwargs: dict[str, Any] = {"Key": self.key(name), "Body": data}
        if create:
            kwargs["IfNoneMatch"] = "*"
        if match is not None:
            kwargs["IfMatch"] = match
        reply = self._call("put_object", name, **kwargs)
        return str(reply["ETag"])

    def upload(self, name: str, parts: Iterator[bytes]) -> None:
        """Write object ``name`` from ``parts`` (each at least 5 MiB but the last).

        One PUT for a single part; a multipart upload otherwise, aborted if it fails.
        """
        first = next(parts, b"")
        second = next(parts, None)
        if second is None:
            self.put(name, first)
            return
        key = self.key(name)
        upload = self._call("create_multipart_upload", name, Key=key)["UploadId"]
        done = []
        try:
            for number, body in enumerate(itertools.chain((first, second), parts), 1):
                reply = self._call(
                    "upload_part", name, Key=key, UploadId=upload, PartNumber=number, Body=body
                )
                done.append({"PartNumber": number, "ETag": reply["ETag"]})
            self._call(
                "complete_multipart_upload", name, Key=key, UploadId=upload,
                MultipartUpload={"Parts": done},
            )  # fmt: skip
        except BaseException:
            self._call("abort_multipart_upload", name, Key=key, UploadId=upload)
            raise

    def download(self, name: str, chunk: int = 8 << 20) -> Iterator[bytes]:
        """Object ``name``'s bytes, in pieces of at most ``chunk``.

        Raises:
            FileNotFoundError: there is no such object.
        """
        body = self._call("get_object", name, Key=self.key(name))["Body"]
        try:
            while data := body.read(chunk):
                yield data
        finally:
            body.close()

    def delete(self, name: str) -> None:
        """Delete object ``name`` (nothing if it is not there)."""
        self._call("delete_object", name, Key=self.key(name))

    def listing(self, name: str = "", *, delimiter: bool = False) -> Iterator[Listed | str]:
        """Every object under ``name/`` (paginated), and with ``delimiter`` each sub-prefix.

        Yields :class:`Listed` objects and, with ``delimiter``, the names (relative to
        the root, ending in ``/``) of the prefixes one level down.
        """
        prefix = self.key(name) + "/" if name else (self.prefix + "/" if self.prefix else "")
        kwargs: dict[str, Any] = {"Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = "/"
        while True:
            reply = self._call("list_objects_v2", name or ".", **kwargs)
            for item in reply.get("Contents", ()):
                yield Listed(
                    key=self.relative(str(item["Key"])),
                    size=int(item["Size"]),
                    etag=str(item.get("ETag", "")),
                    modified=item["LastModified"],
                )
            for common in reply.get("CommonPrefixes", ()):
                yield self.relative(str(common["Prefix"]))
            token = reply.get("NextContinuationToken")
            if not reply.get("IsTruncated") or not token:
                return
            kwargs["ContinuationToken"] = token

    def delete_many(self, names: Iterable[str]) -> list[str]:
        """Delete objects in batches of :data:`DELETE_BATCH`; the names that failed."""
        failed: list[str] = []
        batch: list[str] = []
        for name in names:
            batch.append(name)
            if len(batch) == DELETE_BATCH:
                failed += self._delete_batch(batch)
                batch = []
        if batch:
            failed += self._delete_batch(batch)
        return failed

    def _delete_batch(self, names: list[str]) -> list[str]:
        objects = [{"Key": self.key(n)} for n in names]
        reply = self._call("delete_objects", names[0], Delete={"Objects": objects, "Quiet": True})
        return [self.relative(str(e["Key"])) for e in reply.get("Errors", ())]

    def uploads(self, name: str = "") -> list[Upload]:
        """Multipart uploads under ``name/`` that were neither completed nor aborted."""
        prefix = self.key(name) + "/" if name else (self.prefix + "/" if self.prefix else "")
        kwargs: dict[str, Any] = {"Prefix": prefix}
        found: list[Upload] = []
        while True:
            reply = self._call("list_multipart_uploads", name or ".", **kwargs)
            found += [
                Upload(self.relative(str(u["Key"])), str(u["UploadId"]), u["Initiated"])
                for u in reply.get("Uploads", ())
            ]
            if not reply.get("IsTruncated"):
                return found
            kwargs["KeyMarker"] = reply.get("NextKeyMarker", "")
            kwargs["UploadIdMarker"] = reply.get("NextUploadIdMarker", "")

    def abort(self, upload: Upload) -> None:
        """Abort a multipart upload (its parts are freed)."""
        self._call(
            "abort_multipart_upload",
            upload.key,
            Key=self.key(upload.key),
            UploadId=upload.upload_id,
        )

    def _call(self, op: str, name: str, **kwargs: Any) -> Any:
        """Make one request; map what the store says to the errors above.

        Raises:
            FileNotFoundError: no such object (GET, HEAD).
            Precondition: a conditional write lost (412; 409 for a concurrent one).
            StoreError: anything else, with a message that says what to fix.
        """
        self.requests += 1
        where = f"{self.url}/{name}" if name != "." else self.url
        try:
            return getattr(self._client, op)(Bucket=self.name, **kwargs)
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            message = str(error.get("Message", "")) or code
            if status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise Precondition(errno.EEXIST, f"{where}: {code} ({status})") from None
            if status == 409 and op == "put_object":
                raise Precondition(errno.EAGAIN, f"{where}: {code} ({status})") from None
            if code == "NoSuchBucket":
                raise StoreError(
                    errno.ENOENT,
                    f"bucket {self.name!r} does not exist at {self.endpoint}; create it, or fix "
                    "the root's URL or endpoint",
                ) from None
            if code in _MISSING or status == 404:
                raise FileNotFoundError(errno.ENOENT, f"{where} does not exist") from None
            if code in _DENIED or status == 403:
                raise StoreError(
                    errno.EACCES,
                    f"{self.endpoint} denied {op} on {where} ({code}: {message}); check the "
                    "credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE or the root's [roots.s3]) and "
                    "their permissions",
                ) from None
            if code in _FULL or status == 507:
                raise StoreError(errno.ENOSPC, f"{where}: the store is full ({code})") from None
            raise StoreError(
                errno.EIO, f"{op} on {where} failed: {code} ({status}) {message}"
            ) from None
        except botocore.exceptions.EndpointConnectionError as exc:
            raise StoreError(
                errno.ECONNREFUSED,
                f"cannot reach the store at {self.endpoint} for {self.url} ({exc}); check the "
                "endpoint (AWS_ENDPOINT_URL or the root's [roots.s3] endpoint_url)",
            ) from None
        except botocore.exceptions.NoCredentialsError:
            raise StoreError(
                errno.EACCES,
                f"no credentials for {self.url}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the root's [roots.s3] keys",
            ) from None
        except botocore.exceptions.BotoCoreError as exc:
            raise StoreError(errno.EIO, f"{op} on {where} failed: {exc}") from None
