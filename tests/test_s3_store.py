"""The object-store storage against real S3 servers: SeaweedFS, and moto for the races.

The commit race, the pointer race and retention's facts and gc run on both servers;
the probe, the errors, the verification and a retirement of 1,100 objects on SeaweedFS
(the store the demo uses).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest

from daemon.base._errors import ConfigError, PromotionError, VerificationError
from daemon.config._config import RootConfig, load_config
from daemon.config._s3 import S3Options
from daemon.store._facts import StepRetention
from daemon.store._routed import RoutedStorage
from daemon.store._s3 import S3Storage
from daemon.store._s3client import Bucket, StoreError
from daemon.store._s3commit import COMMIT_NAME
from daemon.store._s3probe import StoreRefused, probe
from daemon.store._verify import Manifest
from orchestrator.protocol import FileEntry
from tests._s3 import ACCESS_KEY, SECRET_KEY, LyingProxy, S3Server, serve, start_seaweedfs
from tests.test_forms_verify import per_rank_files


@pytest.fixture(scope="module")
def seaweed() -> Iterator[S3Server]:
    yield from serve("seaweedfs")


@pytest.fixture(scope="module")
def moto() -> Iterator[S3Server]:
    yield from serve("moto")


@pytest.fixture(params=["seaweedfs", "moto"])
def server(request: pytest.FixtureRequest) -> S3Server:
    """Each of the two servers in turn."""
    found: S3Server = request.getfixturevalue("seaweed" if request.param == "seaweedfs" else "moto")
    return found


def options(server: S3Server, secret: str = SECRET_KEY) -> S3Options:
    return S3Options(
        endpoint_url=server.endpoint,
        region="us-east-1",
        access_key_id=ACCESS_KEY,
        secret_access_key=secret,
        addressing_style="path",
    )


def s3_root(server: S3Server, **kwargs: object) -> RootConfig:
    url = server.root()
    return RootConfig(path=url, real=url, s3=options(server), **kwargs)  # type: ignore[arg-type]


def manifest(root: RootConfig, step: int, attempt: str) -> Manifest:
    return Manifest(
        root=root.path,
        step=step,
        world_size=1,
        created="2026-01-01T00:00:00+00:00",
        bytes=0,
        files={},
        dirs=["."],
        dcp_dirs=[],
        attempt=attempt,
    )


def commit_step(storage: S3Storage, root: RootConfig, step: int, attempt: str) -> None:
    """Write an attempt's object, verify it and commit it, as the daemon does."""
    storage.prepare(root, step, attempt, 1)
    bucket = storage.bucket(root)
    bucket.put(f"step_{step}/{attempt}/weights.bin", b"w" * 100)
    found = storage.scan_save(root, step, 1, {0: (FileEntry("weights.bin", 100),)}, attempt)
    storage.promote(root, step, found)


class TestConfig:
    """s3:// roots in flags and TOML, with per-root overrides."""

    def test_a_root_url_and_its_table(self, tmp_path: Path) -> None:
        toml = tmp_path / "c.toml"
        toml.write_text(
            '[[roots]]\npath = "s3://ckpt/runs/r1"\n'
            '[roots.s3]\nendpoint_url = "http://127.0.0.1:9"\nregion = "eu-west-1"\n'
        )
        config = load_config(
            config_file=str(toml), roots=["s3://ckpt/runs/r2"], state_dir=str(tmp_path)
        )
        first, second = config.roots
        assert first.path == "s3://ckpt/runs/r1" and first.on_object_store
        assert first.s3 == S3Options(endpoint_url="http://127.0.0.1:9", region="eu-west-1")
        assert second.path == "s3://ckpt/runs/r2" and second.s3 is None
        assert first.save_dir(5, "a" * 16) == f"s3://ckpt/runs/r1/step_5/{'a' * 16}"

    @pytest.mark.parametrize(
        ("url", "says"),
        [
            ("s3://Bad_Bucket/x", "not a valid S3 bucket name"),
            ("s3://ckpt/x/", "trailing"),
            ("s3://ckpt/x/../y", "'..'"),
            ("s3://ckpt//y", "empty part"),
        ],
    )
    def test_a_bad_url_says_how_to_fix_it(self, tmp_path: Path, url: str, says: str) -> None:
        with pytest.raises(ConfigError, match=says):
            load_config(roots=[url], state_dir=str(tmp_path))

    def test_overrides_are_checked(self, tmp_path: Path) -> None:
        toml = tmp_path / "c.toml"
        toml.write_text('[[roots]]\npath = "s3://ckpt/r"\n[roots.s3]\naccess_key_id = "k"\n')
        with pytest.raises(ConfigError, match="both access_key_id and secret_access_key"):
            load_config(config_file=str(toml), state_dir=str(tmp_path))
        toml.write_text('[[roots]]\npath = "s3://ckpt/r"\n[roots.s3]\nendpoint = "x"\n')
        with pytest.raises(ConfigError, match="unknown keys in \\[roots.s3\\]"):
            load_config(config_file=str(toml), state_dir=str(tmp_path))
        local = tmp_path / "run"
        local.mkdir()
        toml.write_text(f'[[roots]]\npath = "{local}"\n[roots.s3]\nregion = "x"\n')
        with pytest.raises(ConfigError, match="only for s3:// roots"):
            load_config(config_file=str(toml), state_dir=str(tmp_path))


class TestProbe:
    """A store that ignores conditional writes is refused at start; errors say what to fix."""

    def test_a_real_store_passes(self, seaweed: S3Server) -> None:
        root = s3_root(seaweed)
        probe(Bucket(root.path, root.s3))
        assert not [k for k in seaweed.keys(root.path) if "probe" in k]  # cleaned up

    def test_a_store_that_ignores_the_headers_is_refused(self, tmp_path: Path) -> None:
        honest = start_seaweedfs(auth=False)
        proxy = LyingProxy(honest.endpoint)
        try:
            url = f"s3://{honest.bucket}/lied-to"
            opts = S3Options(
                endpoint_url=proxy.endpoint,
                access_key_id="any",
                secret_access_key="any",
                addressing_style="path",
            )
            root = RootConfig(path=url, real=url, s3=opts)
            storage = S3Storage()
            with pytest.raises(StoreRefused, match="ignores If-None-Match"):
                storage.write_layout(root)
            with pytest.raises(StoreRefused):  # and it stays refused
                storage.bucket(root)
        finally:
            proxy.close()
            honest.stop()

    def test_bad_credentials(self, seaweed: S3Server) -> None:
        url = seaweed.root()
        bucket = Bucket(url, options(seaweed, secret="wrong"))
        with pytest.raises(StoreError, match="denied .* check the credentials"):
            probe(bucket)

    def test_a_missing_bucket(self, seaweed: S3Server) -> None:
        bucket = Bucket(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/r", options(seaweed))
        with pytest.raises(StoreError, match="does not exist at .*create it"):
            probe(bucket)

    def test_an_unreachable_endpoint(self) -> None:
        from tests._ranks import free_port

        opts = S3Options(
            endpoint_url=f"http://127.0.0.1:{free_port()}",
            access_key_id="k",
            secret_access_key="s",
            connect_timeout=2,
        )
        with pytest.raises(StoreError, match="cannot reach the store"):
            probe(Bucket("s3://ckpt/r", opts))


class TestVerify:
    """Verification by LIST and .metadata, against what ranks reported."""

    def test_a_missing_reported_object_fails_and_nothing_is_committed(
        self, seaweed: S3Server
    ) -> None:
        storage, root = S3Storage(), s3_root(seaweed)
        storage.prepare(root, 3, "a" * 16, 1)
        storage.bucket(root).put(f"step_3/{'a' * 16}/one.bin", b"1" * 10)
        reported: dict[int, tuple[FileEntry, ...]] = {
            0: (FileEntry("one.bin", 10), FileEntry("two.bin", 5))
        }
        with pytest.raises(VerificationError, match="two.bin"):
            storage.scan_save(root, 3, 1, reported, "a" * 16)
        assert not storage.promoted(root, 3)

    def test_another_attempts_objects_never_join(self, seaweed: S3Server) -> None:
        storage, root = S3Storage(), s3_root(seaweed)
        old, new = "0" * 16, "1" * 16
        storage.prepare(root, 4, old, 1)
        storage.bucket(root).put(f"step_4/{old}/stale.bin", b"s" * 10)
        commit_step(storage, root, 4, new)  # a retry at once, no gc first
        commit = storage.read_commit(root, 4)
        assert commit is not None and commit.attempt == new
        assert sorted(commit.objects) == ["weights.bin"]
        assert storage.locate(root, 4) == f"{root.path}/step_4/{new}"
        assert storage.verify_checkpoint(root.final_dir(4)) == []
        storage.bucket(root).put(f"step_4/{new}/weights.bin", b"x" * 99)
        assert "weights.bin changed" in storage.verify_checkpoint(root.final_dir(4))[0]

    def test_per_rank_metadata_and_an_unknown_form(self, seaweed: S3Server, tmp_path: Path) -> None:
        # Files torch wrote without collectives (tests/test_forms_verify.py), uploaded.
        storage, root, attempt = S3Storage(), s3_root(seaweed), "c" * 16
        storage.prepare(root, 5, attempt, 2)
        bucket = storage.bucket(root)
        local = per_rank_files(tmp_path / "ckpt")
        for path in sorted(local.iterdir()):
            bucket.put(f"step_5/{attempt}/model/{path.name}", path.read_bytes())
        assert storage.scan_save(root, 5, 2, {}, attempt).dcp_dirs == ["model"]
        bucket.delete(f"step_5/{attempt}/model/__1.metadata")
        with pytest.raises(VerificationError, match="model/__1_0.distcp: no __1.metadata"):
            storage.scan_save(root, 5, 2, {}, attempt)
        storage.prepare(root, 6, attempt, 1)
        bucket.put(f"step_6/{attempt}/model.pt", b"p" * 10)
        with pytest.raises(VerificationError, match="unknown save form"):
            storage.scan_save(root, 6, 1, {0: ()}, attempt)


@pytest.mark.slow  # eight racing daemons a store
class TestCommitRace:
    """Of many daemons committing one step, exactly one wins; the rest stand down."""

    def test_one_winner(self, server: S3Server) -> None:
        root = s3_root(server)
        storage = S3Storage()
        attempts = [uuid.uuid4().hex[:16] for _ in range(8)]
        storage.bucket(root)  # probed once, before the race
        barrier = threading.Barrier(len(attempts))

        def commit(attempt: str) -> str | None:
            mine = S3Storage(probe_roots=False)  # a daemon of its own
            barrier.wait(30)
            try:
                mine.promote(root, 9, manifest(root, 9, attempt))
            except PromotionError as exc:
                assert "another daemon committed step 9 first" in str(exc)
                return None
            return attempt

        with ThreadPoolExecutor(len(attempts)) as pool:
            won = [a for a in pool.map(commit, attempts) if a is not None]
        assert len(won) == 1
        commit_object = storage.read_commit(root, 9)
        assert commit_object is not None and commit_object.attempt == won[0]
        assert storage.read_pointer(root) == 9


@pytest.mark.slow  # eight racing daemons a store
class TestPointerRace:
    """``latest`` moves forward only, whatever order racing promotions reach it in."""

    def test_newest_wins(self, server: S3Server) -> None:
        root = s3_root(server)
        storage = S3Storage()
        storage.bucket(root)
        steps = list(range(1, 9))
        barrier = threading.Barrier(len(steps))

        def finish(step: int) -> bool:
            mine = S3Storage(probe_roots=False)
            bucket = mine.bucket(root)
            attempt = f"{step:016x}"
            mine_commit = manifest(root, step, attempt)
            barrier.wait(30)
            done = mine.promote(root, step, mine_commit)
            assert bucket.head(f"step_{step}/{COMMIT_NAME}") is not None
            return done.pointer_moved

        with ThreadPoolExecutor(len(steps)) as pool:
            moved = list(pool.map(finish, steps))
        assert moved[-1]  # the newest always lands
        assert storage.read_pointer(root) == 8
        assert storage.latest_promoted(root) == 8
        # A late, older promotion never moves it back.
        with pytest.raises(PromotionError):  # step 3 is committed already
            storage.promote(root, 3, manifest(root, 3, "f" * 16))
        assert storage.promote(root, 9, manifest(root, 9, "e" * 16)).pointer_moved
        assert not storage.finish(root, 3).pointer_moved
        assert storage.read_pointer(root) == 9


class TestRetention:
    """Retirement deletes the commit object first, then only what ckptd's naming owns."""

    def test_retire_and_what_is_never_touched(self, seaweed: S3Server) -> None:
        # On one server: its 1,100 objects (deletion in batches of 1,000) are the
        # suite's largest S3 job; the other retention tests run on both.
        server = seaweed
        storage, root = S3Storage(), s3_root(server)
        attempts = {step: uuid.uuid4().hex[:16] for step in (1, 2, 3)}
        for step, attempt in attempts.items():
            commit_step(storage, root, step, attempt)
        bucket = storage.bucket(root)
        bucket.put("step_2/notes/readme.txt", b"hand-made")  # not an attempt's name
        bucket.put("other/data.bin", b"not ckptd's")
        bucket.put("step_9/x.bin", b"no marker, no commit")
        client = server.client()
        prefix = root.path.split("/", 3)[3]
        upload = client.create_multipart_upload(
            Bucket=server.bucket, Key=f"{prefix}/step_1/{attempts[1]}/big.bin"
        )
        # Many objects: deletion goes in batches of 1,000.
        many = [f"step_1/{attempts[1]}/shard-{i:04d}" for i in range(1100)]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda name: bucket.put(name, b"."), many))

        found = storage.scan_steps(root, {})
        assert [f.step for f in found] == [1, 2, 3] and all(f.complete for f in found)
        moved, refused = storage.retire(root, [1, 2])
        assert sorted(moved) == [1, 2] and refused == {}
        keys = server.keys(root.path)
        assert not [k for k in keys if k.startswith(("step_1/", f"step_2/{attempts[2]}"))]
        assert "step_2/notes/readme.txt" in keys
        assert "other/data.bin" in keys and "step_9/x.bin" in keys
        assert f"step_3/{COMMIT_NAME}" in keys
        uploads = client.list_multipart_uploads(Bucket=server.bucket, Prefix=prefix + "/")
        assert upload["UploadId"] not in [u["UploadId"] for u in uploads.get("Uploads", ())]
        assert [f.step for f in storage.scan_steps(root, {})] == [3]

    def test_facts_and_pointers_are_objects(self, server: S3Server) -> None:
        storage, root = S3Storage(), s3_root(server)
        commit_step(storage, root, 5, "5" * 16)
        facts = StepRetention(step=5, attempt="5" * 16, pinned=True, metrics={"loss": 0.5})
        storage.write_facts(root, facts)
        storage.write_pointer(root, "best", 5)
        storage.write_best_name(root, "best")
        again = S3Storage()  # a daemon on an empty state directory reads them back
        assert again.read_facts(root) == {5: facts}
        assert again.read_named_pointer(root, "best") == 5
        assert again.read_best_name(root) == "best"
        assert msgspec.json.decode(server.client().get_object(
            Bucket=server.bucket, Key=root.path.split("/", 3)[3] + "/best"
        )["Body"].read())["url"] == f"{root.path}/step_5/{'5' * 16}"  # fmt: skip
        again.remove_facts(root, 5)
        assert again.read_facts(root) == {}

    def test_gc_takes_a_failed_attempt_and_nothing_else(self, server: S3Server) -> None:
        storage, root = S3Storage(), s3_root(server)
        failed, good = "a" * 16, "b" * 16
        storage.prepare(root, 6, failed, 1)
        storage.bucket(root).put(f"step_6/{failed}/part.bin", b"p")
        dirs = storage.tmp_dirs(root, {6: failed}, (), 3600)
        assert [(d.step, d.failed, d.qualifies) for d in dirs] == [(6, True, True)]
        commit_step(storage, root, 6, good)  # retried at once, before any gc
        kept = storage.kept_entries(root)
        assert [(k.step, k.attempt) for k in kept] == [(6, failed)]
        storage.doom(root, [], [k.name for k in kept])
        keys = server.keys(root.path)
        assert not [k for k in keys if failed in k]
        assert f"step_6/{good}/weights.bin" in keys


class TestRouting:
    """One daemon, roots of both kinds: each call goes to its root's storage."""

    def test_local_and_s3_side_by_side(self, seaweed: S3Server, tmp_path: Path) -> None:
        routed = RoutedStorage()
        s3 = s3_root(seaweed)
        local = RootConfig(path=str(tmp_path), real=str(tmp_path))
        assert routed.entries(local) == []
        routed.write_layout(s3)
        assert ".ckptd-layout.json" in routed.entries(s3)
        assert routed.read_pointer(s3) is None


class TestCommandLine:
    """``ckptd`` on an s3:// root whose store refuses it: a clear error, no traceback."""

    def test_denied(
        self,
        seaweed: S3Server,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
    ) -> None:
        from daemon.cli import main

        for key, value in {**seaweed.env(), "AWS_SECRET_ACCESS_KEY": "wrong"}.items():
            monkeypatch.setenv(key, value)
        root = seaweed.root()
        assert main(["ls", root, "--socket", "/nonexistent/ckptd.sock"]) == 1
        err = capsys.readouterr().err
        assert "denied" in err and "check the credentials" in err
        assert main(["verify", f"{root}/step_1"]) == 1
        assert "denied" in capsys.readouterr().err
