"""The one way files of a run are written: whole or not at all.

A reader (a resumed run, the report, a user's script) never meets a half-written
file, even when the writer is killed or the node loses power mid-write: the
bytes go to a temporary file beside the target, are flushed and fsynced, and
replace the target in one rename (atomic on POSIX filesystems, NFS and Lustre
included); the directory is fsynced so the rename itself survives a crash.
On object storage a single PUT is atomic: the object is written in one.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import overload

from raytrain_ddp.storage import RemotePath


@overload
def write_atomic(path: RemotePath, data: str | bytes) -> RemotePath: ...
@overload
def write_atomic(path: str | os.PathLike, data: str | bytes) -> Path: ...
def write_atomic(path, data):
    """Write `data` (text as UTF-8) to `path` atomically; return the path. On object storage (a RemotePath,
    raytrain_ddp.storage) one PUT is atomic already."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if isinstance(path, RemotePath):
        path.write_bytes(payload)
        return path
    path = Path(path)
    # Unique per writer: two processes writing the same file never share a temporary file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as file:
            file.write(payload)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def create_private(path: str | os.PathLike, data: str) -> Path:
    """Create `path` readable and writable by its owner only (0600, whatever the umask), holding `data`.

    Created exclusively and never through a symlink: an existing file or a link planted at `path` is an
    error (FileExistsError), not something written through.
    """
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only remove bits; this states the mode outright
        os.write(fd, data.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # a filesystem that cannot open directories (some FUSE mounts): the rename stands
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported for directories there
    finally:
        os.close(fd)
