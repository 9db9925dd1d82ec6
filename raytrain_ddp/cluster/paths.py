"""The job's directories and token file on nodes shared with other jobs and users.

Ray makes its temp dir and every directory in it 0777, so another user could replace its sockets or
delete its logs: each node's Ray temp dir is nested inside a 0700 directory the job owns
(`private_dir`), and a path that already exists but is a symlink or belongs to someone else is
refused in one line instead of followed or reused. A configurable base (RAYTRAIN_TMPDIR,
RAYTRAIN_JOB_DIR_BASE) is only ever created, never chmodded: it may be a shared group directory.
"""

from __future__ import annotations

import os
import shutil
import stat

from raytrain_ddp.files import create_private


class UnsafePath(Exception):
    """A path the job must not use: the message is one line naming it."""


def unsafe(path: str, uid: int | None = None) -> str | None:
    """Why the existing `path` must not be used by a job of user `uid` (default: ours), or None.

    A path that does not exist is safe to create."""
    uid = os.geteuid() if uid is None else uid
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink (to {os.readlink(path)}); refusing to follow it"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} exists and is not a directory"
    if st.st_uid != uid:
        return f"{path} exists and belongs to uid {st.st_uid}, not to this job's user (uid {uid})"
    return None


def private_dir(path: str) -> None:
    """A fresh, empty directory at `path`, mode 0700, owned by us; a stale one of ours is replaced.

    Missing parents are created 0700; existing ones are left as they are. Raises UnsafePath."""
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, mode=0o700, exist_ok=True)
    for _ in range(2):
        try:
            os.mkdir(path, 0o700)
            return
        except FileExistsError:
            why = unsafe(path)
            if why:
                raise UnsafePath(why) from None
            shutil.rmtree(path)  # ours, from an earlier run of this job id (a requeue); rmtree never follows links
    raise UnsafePath(f"{path} keeps coming back after removal; refusing to use it")


def remove_own_dir(path: str) -> None:
    """Remove `path` if it is a directory of ours (never through a symlink, never someone else's)."""
    if os.path.lexists(path) and not unsafe(path):
        shutil.rmtree(path, ignore_errors=True)


def create_secret(path: str, text: str) -> None:
    """Write `text` to a new file only we can read: never an existing file, never through a symlink."""
    try:
        create_private(path, text)
    except FileExistsError:  # a file or a planted link
        raise UnsafePath(f"{path} already exists; refusing to reuse it as this job's token") from None
