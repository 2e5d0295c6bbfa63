"""Files the journal service and kvreplay write and read: made fresh, installed without replacing
what someone else put there, read only when they are regular files.

A journal often lies in a shared directory (the README's example is ``/tmp/run.kvj``), where
another user can plant a name before the writer gets to it: a symlink ``P.tmp -> ~/.bashrc``,
or a FIFO where a snapshot is expected. So a file is written under a fresh name, then installed
(:func:`write_whole`), and read only through :func:`open_regular`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import BinaryIO, Final, NamedTuple

# Names longer than this are cut in the temporary name, which must stay under NAME_MAX (255).
_TEMP_NAME_KEEP: Final = 200
# errno values of a file system that has no hard links (vfat, some FUSE and network mounts).
_NO_LINKS: Final = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK})


class FileId(NamedTuple):
    """Which file a name points to: compared before replacing it."""

    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileId:
        return cls(st.st_dev, st.st_ino)


class NotRegularFileError(OSError):
    """A path that should hold a regular file holds a FIFO, a device, a directory or a socket."""


def kind(mode: int) -> str:
    """What a ``st_mode`` is, in words, for messages."""
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def lstat(path: str) -> os.stat_result | None:
    """``os.lstat``, or None when nothing has the name."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def create_temp(near: str) -> tuple[str, BinaryIO]:
    """A new, empty file beside ``near`` under an unpredictable name, open unbuffered for writing.

    The name is ``.NAME.<16 hex digits>.tmp`` (hidden, and never a name another writer uses).
    ``O_EXCL|O_NOFOLLOW``: if the name exists, even as a dangling symlink, the open fails and
    another name is drawn; nothing existing is ever opened.
    """
    folder, name = os.path.split(near)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(16):
        tmp = os.path.join(folder, f".{name[:_TEMP_NAME_KEEP]}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
        except FileExistsError:
            continue
        return tmp, os.fdopen(fd, "wb", buffering=0)
    raise FileExistsError(errno.EEXIST, "no free temporary name after 16 tries", near)


def install(tmp: str, path: str, *, replacing: FileId | None = None) -> None:
    """Gives the finished temporary file ``tmp`` the name ``path``.

    With ``replacing`` None, ``path`` must not exist: the file is hard-linked there, which fails
    with ``FileExistsError`` if anything has the name (a file, a symlink, a device node), and
    the temporary name is removed. On a file system without hard links the check and the rename
    are two steps. With ``replacing``, ``path`` must still be that very file (the one this writer
    installed before), which the rename then replaces atomically.

    NOTE: that file is checked by device and inode (``FileId``), so a file swapped in meanwhile
    is not replaced.
    """
    if replacing is not None:
        st = lstat(path)
        if st is None or FileId.of(st) != replacing or not stat.S_ISREG(st.st_mode):
            what = "gone" if st is None else f"{kind(st.st_mode)} this writer did not make"
            raise FileExistsError(errno.EEXIST, f"no longer the file this writer made ({what}); not replacing it", path)
        os.rename(tmp, path)
        return
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "exists already; not replacing it", path) from None
    except OSError as exc:
        if exc.errno not in _NO_LINKS:
            raise
        if lstat(path) is not None:
            raise FileExistsError(errno.EEXIST, "exists already; not replacing it", path) from None
        os.rename(tmp, path)
        return
    os.unlink(tmp)


def discard(tmp: str) -> None:
    """Removes a temporary file after a failure; a failure to remove it is not reported."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def write_whole(path: str, body: bytes, *, sync: bool = False, replacing: FileId | None = None) -> FileId:
    """Writes ``body`` to ``path``: under a fresh name, then installed (see ``install``:
    ``replacing`` None means ``path`` must not exist). Returns the new file's id, to pass as
    ``replacing`` next time. ``sync``: on the disk, rename included, before it returns.
    Raises ``OSError``; nothing is left behind but the file installed.

    NOTE: a file is never opened for writing under its final name. It is written under a fresh,
    unpredictable name (:func:`create_temp`: ``O_CREAT|O_EXCL|O_NOFOLLOW``, so a planted name or
    link makes the open fail instead of being written through), then given its name by
    :func:`install`."""
    tmp, f = create_temp(path)
    try:
        with f:
            done = 0
            while done < len(body):  # a regular file writes short only when the disk fills up
                wrote = f.write(body[done:])
                if not wrote:
                    raise OSError(f"short write ({done} of {len(body)} bytes)")
                done += wrote
            if sync:
                os.fsync(f.fileno())
            fid = FileId.of(os.fstat(f.fileno()))
        install(tmp, path, replacing=replacing)
    except BaseException:
        discard(tmp)
        raise
    if sync:
        fsync_dir(path)
    return fid


def fsync_dir(path: str) -> None:
    """Makes a rename or link in the folder of ``path`` durable."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_regular(path: str, *, follow: bool = True, buffering: int = -1) -> tuple[BinaryIO, os.stat_result]:
    """Opens ``path`` for reading if it is a regular file; raises ``NotRegularFileError`` if not.

    ``O_NONBLOCK`` so that a FIFO without a writer cannot block the open; it has no effect on a
    regular file. ``follow=False`` also refuses a symlink (``O_NOFOLLOW``).

    NOTE: what is not a regular file is refused because a FIFO would block ``open`` forever and
    ``/dev/zero`` never ends; a regular file's size then bounds the read (:func:`read_regular`).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise NotRegularFileError(errno.ELOOP, "a symbolic link, not a regular file", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(errno.EINVAL, f"{kind(st.st_mode)}, not a regular file", path)
        return os.fdopen(fd, "rb", buffering=buffering), st
    except BaseException:
        os.close(fd)
        raise


def create_or_truncate(path: str) -> BinaryIO:
    """Opens ``path`` for writing, unbuffered, empty: created, or a regular file there truncated.

    For outputs the user names (``-o``, the recorder's journal path), where replacing a regular
    file is what is asked. Anything else at the name is refused with ``NotRegularFileError``
    before it is opened (a symlink is never followed: ``O_NOFOLLOW``; a device or FIFO is not
    opened, which for some devices acts) and again after, from the opened file itself, in case
    the name was swapped in between (``O_NONBLOCK``: a FIFO swapped in cannot block the open).
    Nothing is truncated until the opened file is known to be a regular file.

    NOTE: such an output is written as it goes (``kvreplay minimize -o``, the recorder's
    journal), so it cannot be written under another name first, as :func:`write_whole` does.
    """
    st = lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(errno.EINVAL, f"{kind(st.st_mode)}, not a regular file: not writing there", path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink, or a FIFO without a reader, swapped in
            what = "a symbolic link" if exc.errno == errno.ELOOP else "a FIFO"
            raise NotRegularFileError(exc.errno, f"{what}, not a regular file: not writing there", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(errno.EINVAL, f"{kind(st.st_mode)}, not a regular file: not writing there", path)
        os.ftruncate(fd, 0)
        return os.fdopen(fd, "wb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str, *, follow: bool = True) -> bytes:
    """The bytes of a regular file, at most its size when opened (it cannot grow the read)."""
    f, st = open_regular(path, follow=follow)
    with f:
        return f.read(st.st_size)
