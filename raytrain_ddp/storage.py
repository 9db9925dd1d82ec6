"""Run directories on object storage: `--storage-path s3://bucket/prefix` (or any URI pyarrow.fs reads).

A local storage path stays a `pathlib.Path` (everything works there exactly
as before). A URI becomes a :class:`RemotePath`: the part of pathlib's
interface the driver uses (``/``, ``name``, ``parent``, ``exists``,
``read_text``, ``glob`` ...) over a ``pyarrow.fs`` filesystem, so the same
code reads and writes a run directory in either place. On object storage a
single PUT is atomic (a reader sees the old object or the new one), which is
what `raytrain_ddp.files.write_atomic` promises locally with a rename.

Credentials come from the environment, as pyarrow and Ray Train read them
(`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, or
`?endpoint_override=...` in the URI): nothing is stored with the run.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import io
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import TypeVar
from urllib.parse import urlsplit

import pyarrow.fs as pafs

from raytrain_ddp.data.paths import is_uri
from raytrain_ddp.errors import STORE_ACTIONS, ConfigError, StorageFull, one_line
from raytrain_ddp.redact import redact

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long one object-store write keeps retrying a store that fails in passing (5xx, throttling, a refused or
# reset connection, a timeout) before the run ends (StorageFull, exit 74): long enough for a store's restart or
# a throttling burst, short enough that a store that is gone does not hold the run. The environment variable
# overrides it (seconds).
RETRY_BUDGET_ENV = "RAYTRAIN_STORAGE_RETRY_S"
RETRY_BUDGET_S = 60.0
RETRY_FIRST_WAIT_S, RETRY_LONGEST_WAIT_S = 0.5, 8.0
# pyarrow's S3 errors carry the AWS error name and the HTTP status in their text (they have no errno); an answer
# without a body (a HEAD's) names no error, only its status: `AWS Error UNKNOWN (HTTP status 503)`
_TRANSIENT = re.compile(
    r"(response code:|HTTP status) (5\d\d|429)|SLOW_?DOWN|THROTTL|SERVICE_UNAVAILABLE|INTERNAL_FAILURE"
    r"|NETWORK_CONNECTION|curlCode|timed? ?out|connection (refused|reset)|broken pipe",
    re.IGNORECASE,
)


class RemotePath:
    """A path on a pyarrow filesystem, spelled as a URI: ``s3://bucket/prefix/name[?query]``."""

    def __init__(self, fs: pafs.FileSystem, scheme: str, path: str, query: str = "") -> None:
        self.fs, self.scheme, self.path, self.query = fs, scheme, path.rstrip("/"), query

    @classmethod
    def from_uri(cls, uri: str, flag: str = "") -> RemotePath:
        """Raises ConfigError (naming `flag`) for a URI pyarrow cannot open (an unknown scheme, a bad option)."""
        try:
            fs, path = _filesystem(uri)
        except (ValueError, OSError) as err:  # ArrowInvalid is a ValueError
            raise ConfigError(f"{flag} {redact(uri)!r}: pyarrow.fs cannot open it: {one_line(err)}".lstrip()) from None
        return cls(fs, urlsplit(uri).scheme, path, urlsplit(uri).query)

    # ------------------------------------------------------------------ pathlib's interface
    def __truediv__(self, other: str) -> RemotePath:
        return RemotePath(self.fs, self.scheme, f"{self.path}/{other}", self.query)

    def __str__(self) -> str:
        """As messages name it: without the query (options such as endpoint_override)."""
        return f"{self.scheme}://{self.path}"

    @property
    def uri(self) -> str:
        """The URI that opens it again (where the summary records a path)."""
        return str(self) + (f"?{self.query}" if self.query else "")

    def __repr__(self) -> str:
        return f"RemotePath({redact(self.uri)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and self.uri == other.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __lt__(self, other: RemotePath) -> bool:  # sorted(glob(...))
        return self.path < other.path

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.fs, self.scheme, str(PurePosixPath(self.path).parent), self.query)

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def _type(self) -> pafs.FileType:
        return self.fs.get_file_info(self.path).type

    def exists(self) -> bool:
        return self._type() != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._type() == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._type() == pafs.FileType.Directory

    def is_symlink(self) -> bool:
        return False

    def read_bytes(self) -> bytes:
        try:
            with self.fs.open_input_stream(self.path) as stream:
                return stream.read()
        except FileNotFoundError:
            raise
        except OSError as err:
            if not self.exists():
                raise FileNotFoundError(str(self)) from err
            raise

    def read_text(self, errors: str = "strict") -> str:
        return self.read_bytes().decode("utf-8", errors=errors)

    def write_bytes(self, data: bytes) -> None:
        """One PUT: on object storage the object is replaced whole or not at all (retried, see `retried`)."""

        def put() -> None:
            with self.fs.open_output_stream(self.path) as stream:
                stream.write(data)

        retried(self.name, self, put)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Object storage has no directories: nothing is made, but pyarrow asks the store (retried, as a write)."""
        retried(self.name, self, lambda: self.fs.create_dir(self.path, recursive=True))

    def rmdir(self) -> None:
        """Like os.rmdir: only an empty directory goes (retried, as a write)."""
        if self.exists() and not list(self.iterdir()):
            retried(self.name, self, lambda: self.fs.delete_dir(self.path), "deleting")

    def unlink(self, missing_ok: bool = False) -> None:
        """Like Path.unlink (retried, as a write)."""
        try:
            retried(self.name, self, lambda: self.fs.delete_file(self.path), "deleting")
        except FileNotFoundError:
            if not missing_ok:
                raise

    def iterdir(self) -> list[RemotePath]:
        infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return [RemotePath(self.fs, self.scheme, info.path, self.query) for info in infos]

    def glob(self, pattern: str) -> list[RemotePath]:
        return [child for child in self.iterdir() if fnmatch.fnmatch(child.name, pattern)]

    def mtime(self) -> float | None:
        info = self.fs.get_file_info(self.path)
        return info.mtime.timestamp() if info.mtime is not None else None


RunPath = Path | RemotePath


@functools.lru_cache(maxsize=16)
def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """One filesystem per storage URI and process (config.run_dir is asked for often)."""
    return pafs.FileSystem.from_uri(uri)


def location(text: str | os.PathLike | RemotePath, flag: str = "") -> RunPath:
    """A storage path or run directory as the user gave it (`flag`: the option, for errors): a Path when local
    (file:// included), else remote. A RemotePath is already one."""
    if isinstance(text, RemotePath):
        return text
    if not is_uri(str(text)):
        return Path(text)
    remote = RemotePath.from_uri(str(text), flag)
    if isinstance(remote.fs, pafs.LocalFileSystem):
        return Path(remote.path)
    return remote


def check_remote(storage: RemotePath, flag: str = "--storage-path") -> None:
    """Before Ray starts: the server answers and the bucket (the path's first part) exists. Raises ConfigError."""
    given = redact(storage.uri)
    bucket = storage.path.split("/", 1)[0]
    try:
        found = storage.fs.get_file_info(bucket).type
    except OSError as err:
        raise ConfigError(f"{flag} {given!r}: the storage cannot be reached: {one_line(err)}") from None
    if found == pafs.FileType.NotFound:
        raise ConfigError(f"{flag} {given!r}: bucket {bucket!r} does not exist (create it first)")


def open_for_read(path: RunPath) -> io.BytesIO | Path:
    """Something torch.load (or np.load) can read: the local path itself, or the remote object's bytes."""
    return path if isinstance(path, Path) else io.BytesIO(path.read_bytes())


def move_tree(source: RunPath, target: RunPath) -> None:
    """Move a directory (a checkpoint) within one storage; object storage copies, then deletes."""
    if isinstance(source, Path) and isinstance(target, Path):
        shutil.move(source, target)
        return
    assert isinstance(source, RemotePath)
    copy_tree(source, target)
    remove_tree(source)


def remove_tree(where: RunPath) -> None:
    """Delete a directory (an unfinished checkpoint) and all it holds (on object storage retried, as a write)."""
    if isinstance(where, Path):
        shutil.rmtree(where)
    else:
        retried(where.name, where, lambda: where.fs.delete_dir(where.path), "deleting")


def copy_tree(source: RunPath, target: RunPath) -> None:
    """Copy a directory (a --resume-from checkpoint) into a run directory, either of them local or remote."""
    if isinstance(source, Path) and isinstance(target, Path):
        shutil.copytree(source, target)
        return
    (source_path, source_fs), (target_path, target_fs) = _fs_path(source), _fs_path(target)

    def copy() -> None:
        target_fs.create_dir(target_path)  # a local target's files are opened in it: it must be there first
        pafs.copy_files(source_path, target_path, source_filesystem=source_fs, destination_filesystem=target_fs)

    retried(f"a copy of {source.name}", target, copy)


@contextlib.contextmanager
def local_copy(where: RunPath) -> Iterator[Path]:
    """A directory as a local path for the `with` block: itself, or a temporary copy from object storage."""
    if isinstance(where, Path):
        yield where
        return
    with tempfile.TemporaryDirectory(prefix="raytrain-copy-") as scratch:
        copy = Path(scratch) / where.name
        copy.mkdir()  # pyarrow makes the directories below it, not the top one
        copy_tree(where, copy)
        yield copy


def _fs_path(where: RunPath) -> tuple[str, pafs.FileSystem]:
    return (str(where), pafs.LocalFileSystem()) if isinstance(where, Path) else (where.path, where.fs)


def uri_of(where: RunPath) -> str:
    """What opens `where` again: the local path, or the URI with its options."""
    return str(where) if isinstance(where, Path) else where.uri


def stored(storage_path: str, fs_path: str) -> RunPath:
    """A path Ray Train reports inside the storage filesystem (no scheme), on that storage."""
    where = location(storage_path)
    return Path(fs_path) if isinstance(where, Path) else RemotePath(where.fs, where.scheme, fs_path, where.query)


class Spool:
    """A local directory for writers that need one (logging's FileHandler, TensorBoard's event files).

    Local runs write straight into the run directory. For a remote one the files
    are written into a private temporary directory and uploaded into the run
    directory by :meth:`upload` (the driver calls it when the run ends); a file
    already there (a resumed run's driver.log) is fetched first so it goes on.
    """

    def __init__(self, target: RunPath, fetch: tuple[str, ...] = ()) -> None:
        self.target = target
        if isinstance(target, Path):
            self.local = target
            return
        self.local = Path(tempfile.mkdtemp(prefix="raytrain-spool-"))
        for name in fetch:
            if (target / name).is_file():
                (self.local / name).write_bytes((target / name).read_bytes())

    def upload(self) -> None:
        """Into the target (retried as every write is); a store that refuses them past the budget leaves them
        here, said in one warning naming where (a log's upload never ends a run)."""
        if isinstance(self.target, Path):
            return
        target = self.target

        def copy() -> None:
            pafs.copy_files(
                str(self.local), target.path, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=target.fs
            )

        try:
            retried(f"the files of {target.name}", target, copy)
        except StorageFull as full:
            log.warning("%s not uploaded (%s); its files stay in %s", target, full.reason, self.local)
            return
        shutil.rmtree(self.local, ignore_errors=True)


def file_states(local: Path) -> dict[str, tuple[int, int]]:
    """(size, mtime in ns) of each file under `local`, by relative name: what tells a changed file."""
    return {
        str(file.relative_to(local)): (stat.st_size, stat.st_mtime_ns)
        for file in sorted(local.rglob("*"))
        if file.is_file() and (stat := file.stat())
    }


def upload_changed(local: Path, target: RunPath, uploaded: dict[str, tuple[int, int]]) -> None:
    """Mirror the files under `local` into `target` (object storage): each new or changed file one PUT, whole or
    not at all; files gone locally are deleted there. `uploaded`: (size, mtime) by relative name as last
    uploaded, updated in place, so an unchanged file is not sent again."""
    now = file_states(local)
    for name, seen in now.items():
        if uploaded.get(name) != seen:
            (target / name).write_bytes((local / name).read_bytes())
            uploaded[name] = seen
    for name in set(uploaded) - set(now):
        (target / name).unlink(missing_ok=True)
        del uploaded[name]


def transient(error: OSError) -> bool:
    """An object-store error that a later attempt may not meet (5xx, throttling, connection, timeout)."""
    return bool(_TRANSIENT.search(str(error)))


def retry_budget_s() -> float:
    return float(os.environ.get(RETRY_BUDGET_ENV, RETRY_BUDGET_S))


def retried(what: str, where: RunPath, write: Callable[[], T], action: str = "writing") -> T:
    """Run `write` (`action`, one of errors.STORE_ACTIONS, `what` at `where`) and return what it returns; on object
    storage retry a transient failure with exponential backoff for up to the retry budget, saying so in one WARNING
    (not one per attempt). A store that still fails then, or that refuses outright (access denied, no bucket),
    raises StorageFull: the run ends at once."""
    if isinstance(where, Path):
        return write()
    deadline, wait, warned = time.monotonic() + retry_budget_s(), RETRY_FIRST_WAIT_S, False
    done = f"{action.capitalize()} {what} {STORE_ACTIONS[action]} {where}"
    while True:
        try:
            written = write()
        except FileNotFoundError:
            raise
        except OSError as err:
            if not transient(err) or time.monotonic() + wait > deadline:
                raise StorageFull.store_failed(err, what, where, action) from err
            if not warned:
                log.warning("%s failed (%s): retrying for up to %.0f s", done, one_line(err), retry_budget_s())
                warned = True
            time.sleep(wait)
            wait = min(2 * wait, RETRY_LONGEST_WAIT_S)
            continue
        if warned:
            log.info("%s succeeded after retrying", done)
        return written
