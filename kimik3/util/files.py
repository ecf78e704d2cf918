"""Atomic writes: every file the package writes appears whole or not at all.

A file is written to a temporary sibling, flushed to disk and renamed over the target (``os.replace`` is atomic
on POSIX and replaces a symlink itself rather than writing through it). A directory (a checkpoint export) is
built in a temporary sibling folder and swapped in, so a reader never sees files of two exports mixed and an
interrupted export leaves the previous one intact.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["atomic_write_text", "atomic_write_bytes", "atomic_path", "staged_directory", "check_writable",
           "check_output_file", "check_output_folder", "require_regular_file", "read_regular_bytes",
           "read_regular_text", "read_json_file"]


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (the directory entry, not only the file's data)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not support fsync on directories; the rename itself is still atomic
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def require_regular_file(path: str | Path, what: str = "file") -> os.stat_result:
    """``path`` must exist and be a regular file (after following a symlink): a FIFO would block its reader
    forever, a device could stream without end. Every problem a ``ValueError`` naming the file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{what} {path} is not a regular file (a FIFO, device or folder is refused)")
    return st


def read_regular_bytes(path: str | Path, what: str = "file", max_bytes: int = 64 << 20) -> bytes:
    """The bytes of ``path``, read only when it is a regular file of at most ``max_bytes``."""
    st = require_regular_file(path, what)
    if st.st_size > max_bytes:
        raise ValueError(f"{what} {path} is {st.st_size} bytes, more than the {max_bytes} such a file can be")
    try:
        with open(path, "rb") as fh:
            return fh.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{what} {path} cannot be read: {e.strerror or e}") from None


def read_regular_text(path: str | Path, what: str = "file", max_bytes: int = 64 << 20) -> str:
    """:func:`read_regular_bytes` decoded as UTF-8."""
    data = read_regular_bytes(path, what, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_json_file(path: str | Path, what: str = "file", max_bytes: int = 64 << 20) -> object:
    """:func:`read_regular_text` parsed as JSON (a ``ValueError`` naming the file and the position)."""
    import json

    text = read_regular_text(path, what, max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None


def check_output_file(path: str | Path) -> Path:
    """Refuse, naming it, an output file path that is neither absent nor a regular file (or a symlink to one):
    a device node (``/dev/null``), a FIFO, a socket, a folder, or a symlink to nothing. Replacing one of those
    would destroy something that is not ours, or fail half-way."""
    path = Path(path)
    if str(path) in ("", "."):
        raise ValueError(f"output path {str(path)!r} names no file")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.stat(path)
        except OSError:
            raise ValueError(f"output {path} is a symlink to {os.readlink(path)!r}, which does not exist; remove "
                             "the link or choose another path") from None
        if not stat.S_ISREG(target.st_mode):
            raise ValueError(f"output {path} is a symlink to something that is not a regular file; choose a file "
                             "path")
    elif stat.S_ISDIR(st.st_mode):
        raise ValueError(f"output {path} is a directory; expected a file path")
    elif not stat.S_ISREG(st.st_mode):
        kind = ("a device node" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else
                "not a regular file")
        raise ValueError(f"output {path} is {kind}; only a regular file (or a new path) is replaced")
    return path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it is synced and renamed onto ``path``.
    On any exception the temporary file is removed and ``path`` is left as it was. ``path`` must be absent or a
    regular file (:func:`check_output_file`)."""
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        _public(tmp_path)
        yield tmp_path
        _fsync_file(tmp_path)
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _public(tmp: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private; the result gets the usual permissions


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(path)


def check_writable(path: str | Path, is_dir: bool = False) -> Path:
    """Fail now, with the reason, if ``path`` (a file, or a folder when ``is_dir``) cannot be written — before a
    long run whose results would otherwise be lost at the end. Creates missing parent folders."""
    path = Path(path)
    folder = path if is_dir else path.parent
    if not is_dir:
        check_output_file(path)
    try:
        if is_dir and path.exists() and not path.is_dir():
            raise ValueError(f"output {path} exists and is not a directory")
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kimik3-write-probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"cannot write to {path}: {e.strerror or e}") from None
    return path


def check_output_folder(path: str | Path, ours: Callable[[Path], bool] | None = None, overwrite: bool = False,
                        what: str = "an earlier output of this command") -> Path:
    """Refuse, naming it, an output folder that is not absent, empty, or ``what`` (``ours(path)`` says so, by
    its content, not by file names): a file, a symlink to nothing or to a file, or a folder of someone else's
    files, which writing into would destroy. ``overwrite`` (``--overwrite``) accepts a non-empty folder."""
    if isinstance(path, str) and not path.strip():
        raise ValueError(f"output folder {path!r} names no folder")
    path = Path(path)
    try:
        if path.is_symlink() and not path.exists():
            raise ValueError(f"output {path} is a symlink to {os.readlink(path)!r}, which does not exist; remove "
                             "the link or choose another folder")
        if path.exists() and not path.is_dir():
            raise ValueError(f"output {path} exists and is not a directory")
        nonempty = path.is_dir() and any(path.iterdir())
    except OSError as e:  # a name too long for the file system, a folder we may not read
        raise ValueError(f"output folder {path}: {e.strerror or e}") from None
    if nonempty and not overwrite and not (ours is not None and ours(path)):
        raise ValueError(f"output folder {path} is not empty and does not hold {what}; choose an empty or new "
                         "folder, or pass overwrite=True (--overwrite) to write into it")
    return path


@contextlib.contextmanager
def staged_directory(path: str | Path, overwrite: bool = False,
                     replaceable: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Yield an empty staging folder beside ``path``; when the block succeeds its files are synced and the folder
    takes ``path``'s place (an earlier folder there is removed only after the new one is complete).

    An existing non-empty ``path`` is replaced only when ``replaceable(path)`` says it is one of ours or
    ``overwrite`` is true; otherwise ``ValueError`` before anything is written. ``path`` itself may be a symlink
    to a folder (the user's choice of location); nothing inside the old folder is ever written through."""
    path = check_output_folder(path, replaceable, overwrite, "a kimik3 export")
    path = Path(os.path.abspath(path))  # "out/." or "." have no usable name for the sibling folders
    if path.is_symlink() and path.is_dir():
        path = path.resolve()
    check_writable(path.parent, is_dir=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".staging", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes it private; the export gets the usual permissions
    old: Path | None = None
    try:
        yield stage
        for f in stage.rglob("*"):
            if f.is_file() and not f.is_symlink():
                os.chmod(f, 0o666 & ~umask)  # some writers create their files private (0600) whatever the umask
                _fsync_file(f)
        _fsync_dir(stage)
        if path.exists():
            # two renames: the old folder moves aside, the new one takes its name; a crash in between leaves the
            # complete old export in the hidden sibling and no folder at `path`, never a mixture
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.rmdir(old)
            os.replace(path, old)
        os.replace(stage, path)
        _fsync_dir(path.parent)
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
        if old is not None and old.exists():
            shutil.rmtree(old, ignore_errors=True)
