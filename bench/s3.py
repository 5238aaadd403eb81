"""Benchmark 10: checkpoints on an object store (a local SeaweedFS), against plain clients.

Three figures, each beside its baseline measured in the same run on the same store:

1. **Promotion of a 1,000-object step.** An attempt's 1,000 objects are uploaded; then
   the clock runs over what the daemon does to promote it in a root's lane:
   verification (paginated LIST of the attempt's prefix, GET of its attempt marker and
   of each ``.metadata``) and the commit (one ``If-None-Match`` PUT) and ``latest``
   (GET, then an ``If-Match`` PUT). The floor is the least any commit by conditional
   write can do: the same LIST pages, one GET and one conditional PUT, by a plain
   botocore client.
2. **Requests per promotion**, counted on the daemon's own client, against the floor's.
3. **Training stall**: what ``orchestrator.async_save(root="s3://...")`` blocks the
   training thread for, against a bare ``dcp.async_save`` with ``FsspecWriter`` to the
   same store (one rank; a real daemon).

    .venv/bin/python -m bench.s3 [--full]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ._common import REPO, BenchResult, Daemon, Row, median, p99, print_table, scratch_dir

__all__ = ["run"]

_OBJECTS = 1000
_KEYS = {"AWS_ACCESS_KEY_ID": "ckptd-bench", "AWS_SECRET_ACCESS_KEY": "ckptd-bench-secret"}


class _Store:
    """A local SeaweedFS (``scripts/local-s3``) for the benchmark's life."""

    def __init__(self, data: Path) -> None:
        env = {**os.environ, **_KEYS}
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "local-s3"), str(data), "ckpt"],
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().decode().strip()
        if not self.endpoint:
            raise RuntimeError("the local SeaweedFS did not start (scripts/local-s3)")

    def env(self) -> dict[str, str]:
        return {
            **_KEYS,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _client(store: _Store) -> Any:
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3",
        endpoint_url=store.endpoint,
        region_name="us-east-1",
        aws_access_key_id=_KEYS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=_KEYS["AWS_SECRET_ACCESS_KEY"],
        config=botocore.config.Config(
            max_pool_connections=32,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def _upload(client: Any, prefix: str, count: int) -> None:
    def put(i: int) -> None:
        client.put_object(Bucket="ckpt", Key=f"{prefix}/shard-{i:05d}.bin", Body=b"x" * 512)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, range(count)))


def _promotions(
    store: _Store, reps: int, objects: int
) -> tuple[list[float], list[float], int, int]:
    """Promotion of an ``objects``-object step by the daemon's storage, and the plain floor."""
    from daemon.config._config import RootConfig
    from daemon.store._s3 import S3Storage
    from orchestrator.protocol import FileEntry

    client = _client(store)
    ours: list[float] = []
    floor: list[float] = []
    requests = floor_requests = 0
    files = tuple(FileEntry(f"shard-{i:05d}.bin", 512) for i in range(objects))
    for rep in range(reps):
        url = f"s3://ckpt/bench-{uuid.uuid4().hex[:8]}"
        root = RootConfig(path=url, real=url)
        storage = S3Storage()
        bucket = storage.bucket(root)  # probed before the clock starts
        attempt = uuid.uuid4().hex[:16]
        storage.prepare(root, 1, attempt, 1)
        _upload(client, f"{url.split('/', 3)[3]}/step_1/{attempt}", objects)
        before = bucket.requests
        start = time.perf_counter()
        manifest = storage.scan_save(root, 1, 1, {0: files}, attempt)
        storage.promote(root, 1, manifest)
        ours.append((time.perf_counter() - start) * 1000)
        requests = bucket.requests - before
        # The floor: the same LIST pages, one GET, one conditional PUT, nothing else.
        prefix = f"{url.split('/', 3)[3]}/step_2/{attempt}"
        _upload(client, prefix, objects)
        client.put_object(Bucket="ckpt", Key=f"{prefix}/.marker", Body=b"m")
        start = time.perf_counter()
        count, token = 0, None
        while True:
            kwargs: dict[str, Any] = {"Bucket": "ckpt", "Prefix": prefix + "/"}
            if token:
                kwargs["ContinuationToken"] = token
            page = client.list_objects_v2(**kwargs)
            count += 1
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated"):
                break
        client.get_object(Bucket="ckpt", Key=f"{prefix}/.marker")["Body"].read()
        client.put_object(Bucket="ckpt", Key=f"{prefix}/commit", Body=b"{}", IfNoneMatch="*")
        floor.append((time.perf_counter() - start) * 1000)
        floor_requests = count + 2
        del rep
    return ours, floor, requests, floor_requests


def _stall(store: _Store, workdir: Path, reps: int, numel: int) -> tuple[list[float], list[float]]:
    """Training-thread time of ``orchestrator.async_save`` vs bare ``dcp.async_save``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict_saver import async_save

    import orchestrator

    from ._common import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    root = f"s3://ckpt/stall-{uuid.uuid4().hex[:8]}"
    daemon = Daemon(workdir, [], extra=["--root", root], keep_events=False).start()
    bare: list[float] = []
    ours: list[float] = []
    try:
        client = orchestrator.CheckpointClient(daemon.socket)
        group = dist.new_group(backend="gloo")
        for step in range(1, reps + 2):
            state = {"w": torch.randn(numel)}
            url = f"{root}-bare/step_{step}"
            start = time.perf_counter()
            bare_fut: Any = async_save(
                state, checkpoint_id=url, storage_writer=FsspecWriter(url, sync_files=False),
                process_group=group,
            )  # fmt: skip
            took = (time.perf_counter() - start) * 1000
            bare_fut.result()
            state = {"w": torch.randn(numel)}
            start = time.perf_counter()
            fut = orchestrator.async_save(state, root=root, step=step, client=client)
            took_ours = (time.perf_counter() - start) * 1000
            fut.result()
            client.wait(root, step, timeout=60)
            if step > 1:  # the first of each pays for s3fs's and the session's set-up
                bare.append(took)
                ours.append(took_ours)
        client.close()
    finally:
        daemon.stop()
        dist.destroy_process_group()
    return ours, bare


def run(
    quick: bool = True, reps: int | None = None, numel: int = 1 << 20, objects: int = _OBJECTS
) -> BenchResult:
    """Run the object-store benchmark; ``quick`` takes fewer samples (``reps``: this many).

    ``objects``: how many objects the promoted step holds (the figures: 1,000).
    """
    reps = reps or (5 if quick else 20)
    with scratch_dir() as workdir:
        store = _Store(workdir / "s3")
        saved = {k: os.environ.get(k) for k in store.env()}
        os.environ.update(store.env())
        try:
            ours, floor, requests, floor_requests = _promotions(store, reps, objects)
            stall_ours, stall_bare = _stall(store, workdir, reps, numel)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            store.close()
    rows = [
        Row(
            "s3", f"{objects} objects", "verify + commit", "ms", median(ours), p99(ours),
            len(ours), median(floor), "LIST pages + GET + conditional PUT",
            median(ours) / median(floor),
        ),
        Row(
            "s3", f"{objects} objects", "requests per promotion", "n", float(requests),
            None, 1, float(floor_requests), "the floor's requests", requests / floor_requests,
        ),
        Row(
            "s3", f"{numel * 4 // 1024} KiB, 1 rank", "training stall per save", "ms",
            median(stall_ours), p99(stall_ours), len(stall_ours), median(stall_bare),
            "bare dcp.async_save (FsspecWriter)", median(stall_ours) / median(stall_bare),
        ),
    ]  # fmt: skip
    raw = {
        "promotion_ms": ours,
        "floor_ms": floor,
        "requests": requests,
        "floor_requests": floor_requests,
        "stall_ms": stall_ours,
        "stall_bare_ms": stall_bare,
    }
    return BenchResult(rows, raw)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--full", action="store_true")
    args = parser.parse_args()
    print_table(run(quick=not args.full).rows)


if __name__ == "__main__":
    main()
