"""Which roots get their per-save checks inline: local filesystems only."""

from __future__ import annotations

from pathlib import Path

from daemon.store._mounts import filesystem_type, is_local, mount_table

_TABLE = """\
/dev/vda1 / ext4 rw,relatime 0 0
server:/export /ckpt nfs4 rw,hard 0 0
tmpfs /ckpt/scratch tmpfs rw 0 0
lustre@tcp:/fs /lus lustre rw 0 0
sshfs#me@host: /mnt/my\\040disk fuse.sshfs rw 0 0
/dev/vdb /data xfs rw 0 0
server:/other /data nfs rw 0 0
"""


class TestFilesystemType:
    """The longest mount point containing the path decides, the last mount winning."""

    def test_longest_prefix(self) -> None:
        assert filesystem_type("/home/u/run", _TABLE) == "ext4"
        assert filesystem_type("/ckpt/run-42", _TABLE) == "nfs4"
        assert filesystem_type("/ckpt/scratch/run", _TABLE) == "tmpfs"
        assert filesystem_type("/ckptx/run", _TABLE) == "ext4"  # not under /ckpt

    def test_escaped_mount_point(self) -> None:
        assert filesystem_type("/mnt/my disk/run", _TABLE) == "fuse.sshfs"

    def test_later_mount_hides_earlier(self) -> None:
        assert filesystem_type("/data/run", _TABLE) == "nfs"

    def test_unknown_without_table(self) -> None:
        assert filesystem_type("/anything", "") is None


class TestIsLocal:
    """Network, FUSE and unknown filesystems keep their checks in a worker thread."""

    def test_local_and_remote(self) -> None:
        assert is_local("/home/u/run", _TABLE)
        assert is_local("/ckpt/scratch/run", _TABLE)
        for remote in ("/ckpt/run", "/lus/run", "/mnt/my disk/run", "/data/run"):
            assert not is_local(remote, _TABLE), remote
        assert not is_local("/run", "")

    def test_this_machines_tmp_path(self, tmp_path: Path) -> None:
        # The suite's roots live here: TestSymlinkConfinement covers the inline check.
        assert filesystem_type(str(tmp_path.resolve()), mount_table()) is not None
