"""Locations on local disk or on any filesystem pyarrow can open from a URI.

Local paths stay plain absolute paths; URIs (s3://, gs://, hdfs://, file://)
are resolved with `pyarrow.fs.FileSystem.from_uri` and turned back into URIs
for callers (Ray Data accepts both forms).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import posixpath
from dataclasses import dataclass
from urllib.parse import urlparse

import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_ddp.errors import ConfigError, one_line

GLOB_CHARS = "*?["


def is_uri(path: str) -> bool:
    return "://" in path


def has_glob(path: str) -> bool:
    return any(char in path for char in GLOB_CHARS)


@dataclass(frozen=True)
class Location:
    """A path inside a filesystem, plus the prefix that turns it back into a URI."""

    filesystem: pafs.FileSystem
    path: str
    uri_prefix: str = ""  # "" for local paths, e.g. "s3://" or "hdfs://namenode:8020"

    @property
    def uri(self) -> str:
        return self.uri_prefix + self.path

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    def join(self, *parts: str) -> Location:
        join = os.path.join if not self.uri_prefix else posixpath.join
        return Location(self.filesystem, join(self.path, *parts), self.uri_prefix)

    def file_type(self) -> pafs.FileType:
        return self.filesystem.get_file_info(self.path).type

    def exists(self) -> bool:
        return self.file_type() != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.file_type() == pafs.FileType.Directory


def resolve(path: str) -> Location:
    """Turn a local path or a URI into a Location; no I/O for local paths."""
    if not is_uri(path):
        return Location(pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(path)))
    try:
        filesystem, inner = pafs.FileSystem.from_uri(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ConfigError(f"cannot open the filesystem for {path}: {one_line(exc)}") from exc
    if isinstance(filesystem, pafs.LocalFileSystem):
        return Location(filesystem, inner)
    parsed = urlparse(path)
    # s3/gs put the bucket into the inner path; hdfs-like schemes keep host:port outside it.
    prefix = f"{parsed.scheme}://" if not inner.startswith("/") else f"{parsed.scheme}://{parsed.netloc}"
    return Location(filesystem, inner, prefix)


def list_files(directory: Location, suffix: str = "") -> list[Location]:
    """Files under `directory` (recursive), sorted, skipping hidden and `_`-prefixed ones."""
    selector = pafs.FileSelector(directory.path, recursive=True)
    infos = directory.filesystem.get_file_info(selector)
    paths = sorted(
        info.path
        for info in infos
        if info.type == pafs.FileType.File
        and not info.base_name.startswith((".", "_"))
        and info.base_name.endswith(suffix)
    )
    return [Location(directory.filesystem, path, directory.uri_prefix) for path in paths]


def expand_glob(pattern: str) -> list[Location]:
    """Files matching a glob; for URIs only the last path component may hold wildcards."""
    if not is_uri(pattern):
        matches = sorted(glob.glob(os.path.expanduser(pattern)))
        local = pafs.LocalFileSystem()
        return [Location(local, os.path.abspath(m)) for m in matches if os.path.isfile(m)]
    parent_uri, _, name_pattern = pattern.rpartition("/")
    if has_glob(parent_uri):
        raise ConfigError(f"in {pattern} only the file name may contain wildcards (*, ?, [])")
    parent = resolve(parent_uri)
    infos = parent.filesystem.get_file_info(pafs.FileSelector(parent.path, allow_not_found=True))
    return [
        Location(parent.filesystem, info.path, parent.uri_prefix)
        for info in sorted(infos, key=lambda info: info.path)
        if info.type == pafs.FileType.File and fnmatch.fnmatch(info.base_name, name_pattern)
    ]
