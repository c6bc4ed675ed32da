"""Which storage directories get L3 lookups on the scheduler thread: local filesystems only."""

from __future__ import annotations

import os

import pytest

from kvstrata.storage import local_fs
from kvstrata.storage.file_backend import FileBackend

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid 0 0
tmpfs /dev/shm tmpfs rw 0 0
server:/export /mnt/kv nfs4 rw,vers=4.2 0 0
sshfs#me@host: /mnt/kv/remote fuse.sshfs rw 0 0
/dev/vdb /mnt/kv/remote/disk xfs rw 0 0
//nas/share /mnt/my\\040cache cifs rw 0 0
"""


@pytest.mark.parametrize("path, fs, local", [
    ("/var/cache/kvstrata", "ext4", True),
    ("/dev/shm/kv", "tmpfs", True),
    ("/mnt/kv", "nfs4", False),
    ("/mnt/kvx", "ext4", True),                 # a sibling whose name starts like the mount point
    ("/mnt/kv/pages", "nfs4", False),
    ("/mnt/kv/remote/pages", "fuse.sshfs", False),
    ("/mnt/kv/remote/disk/pages", "xfs", True),  # the longest mount point wins
    ("/mnt/my cache/kv", "cifs", False),         # an escaped space in the mount table
])
def test_the_deepest_mount_decides(path, fs, local):
    assert local_fs.filesystem_type(path, MOUNTS) == fs
    assert local_fs.is_local_filesystem(path, MOUNTS) is local


def test_an_unreadable_mount_table_means_not_local(monkeypatch, tmp_path):
    monkeypatch.setattr(local_fs, "MOUNTS", str(tmp_path / "no-such-file"))
    assert local_fs.filesystem_type(tmp_path) is None
    assert not local_fs.is_local_filesystem(tmp_path)


def test_file_backend_looks_up_on_the_spot_only_on_a_local_disk(monkeypatch, tmp_path):
    assert FileBackend(4096, tmp_path / "local").local_lookup        # the test's temp dir is a local disk
    table = tmp_path / "mounts"
    table.write_text(f"/dev/vda / ext4 rw 0 0\nserver:/export {os.path.realpath(tmp_path)}/remote nfs4 rw 0 0\n")
    monkeypatch.setattr(local_fs, "MOUNTS", str(table))
    assert not FileBackend(4096, tmp_path / "remote").local_lookup   # an NFS mount: lookups on the worker
    assert FileBackend(4096, tmp_path / "other").local_lookup
