"""Whether a directory lives on a local filesystem (Linux `/proc/self/mounts`).

The file backend answers L3 lookups on the scheduler thread only where a `stat` cannot block for long:
on a network filesystem (NFS, SMB, FUSE mounts such as sshfs, cluster filesystems) a lookup can take
milliseconds, or hang while the server is down, so there lookups stay on the storage worker.
"""

from __future__ import annotations

import os
import re

MOUNTS = "/proc/self/mounts"
# Filesystem types whose metadata calls may go over the network (a `fuse.<name>` type is matched by prefix).
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "ceph", "glusterfs", "lustre",
                        "gpfs", "beegfs", "9p", "afs", "ocfs2", "gfs2", "fuse", "fuseblk"})
_OCTAL = re.compile(r"\\([0-7]{3})")     # /proc/self/mounts writes a space in a path as \040


def filesystem_type(path: str | os.PathLike, mounts: str | None = None) -> str | None:
    """The type of the filesystem holding `path` (the mount with the longest matching mount point), or
    None if the mount table cannot be read. `mounts` is the table's text (read from MOUNTS if None)."""
    if mounts is None:
        try:
            with open(MOUNTS, encoding="utf-8", errors="replace") as fh:
                mounts = fh.read()
        except OSError:
            return None
    target = os.path.realpath(path)
    best, best_type = "", None
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, fields[2]
    return best_type


def is_local_filesystem(path: str | os.PathLike, mounts: str | None = None) -> bool:
    """True when `path` is on a local filesystem; False on a network one or when it cannot be told."""
    fs = filesystem_type(path, mounts)
    return fs is not None and fs not in NETWORK_FS and not fs.startswith("fuse.")
