"""Files on local disk read and written past the page cache: the I/O the disk tier and saved caches use.

`open_direct` opens with `O_DIRECT` where the filesystem allows it (tmpfs does not); the page cache cannot then
answer from RAM, and where it must be done without, `drop_page_cache` evicts a file's pages
(`posix_fadvise(DONTNEED)`). `O_DIRECT` wants offsets, sizes and buffer addresses aligned to the logical block
size: `aligned_buffer` gives page-aligned (`mmap`-allocated) memory in whole `ALIGN` blocks. `PolledReader`
reads with Linux native AIO, polling for completion. `scratch_dir` is a private temporary directory, removed even
when what used it fails. Chapter *Beyond HBM* (book/12_beyond_hbm).
"""

from __future__ import annotations

import ctypes
import errno as errno_module
import mmap
import os
import platform
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvlab.units import cdiv

# O_DIRECT wants offsets, sizes and buffer addresses aligned to the logical block size; 4 KiB covers it.
ALIGN = 4096
# Linux moves at most 2 GiB - 4 KiB in one read or write (MAX_RW_COUNT, include/linux/fs.h), native AIO
# included: larger transfers go in chunks of 1 GiB, a multiple of ALIGN, so every chunk stays aligned.
CHUNK = 1 << 30


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous memory of `nbytes` rounded up to `ALIGN`: page-aligned, as O_DIRECT requires."""
    return mmap.mmap(-1, max(ALIGN, cdiv(nbytes, ALIGN) * ALIGN))


def _preadv(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def read_full(
    fd: int,
    buffer: memoryview | mmap.mmap,
    offset: int,
    read: Callable[[int, memoryview, int], int] = _preadv,
) -> int:
    """Read len(buffer) bytes at `offset` into `buffer`, at most `CHUNK` per call of `read` and again after a
    short read; the bytes read, fewer only where the file ends."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = read(fd, view[done : done + CHUNK], offset + done)
        if n == 0:
            break
        done += n
    return done


def write_full(fd: int, buffer: memoryview | mmap.mmap, offset: int) -> int:
    """Write `buffer` at `offset`, at most `CHUNK` per `pwritev` and again after a short write; the bytes
    written."""
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = os.pwritev(fd, [view[done : done + CHUNK]], offset + done)
        if n == 0:
            raise OSError(f"wrote {done:,} of {len(view):,} bytes: no progress at offset {offset + done:,}")
        done += n
    return done


class _IOCB(ctypes.Structure):
    """Linux's `struct iocb` (linux/aio_abi.h, little-endian field order)."""

    _fields_ = [
        ("data", ctypes.c_uint64),
        ("key", ctypes.c_uint32),
        ("rw_flags", ctypes.c_int32),
        ("opcode", ctypes.c_uint16),
        ("reqprio", ctypes.c_int16),
        ("fildes", ctypes.c_uint32),
        ("buf", ctypes.c_uint64),
        ("nbytes", ctypes.c_uint64),
        ("offset", ctypes.c_int64),
        ("reserved2", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("resfd", ctypes.c_uint32),
    ]


class _IOEvent(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_uint64),
        ("obj", ctypes.c_uint64),
        ("res", ctypes.c_int64),
        ("res2", ctypes.c_int64),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


# Syscall numbers of io_setup, io_destroy, io_getevents, io_submit.
_AIO_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}


class PolledReader:
    """Reads with Linux native AIO, completion polled rather than waited for, where the kernel offers it.

    A synchronous read puts the thread to sleep until the drive answers; on a loaded machine the thread then
    waits for a CPU, often a whole scheduler time slice (milliseconds), which swamps a read of a few MiB and
    varies with the load. Submitting the read and spinning on its completion keeps the thread running, so a read
    costs the drive's time, as for engines that poll for completions (SPDK, io_uring's polled mode). Falls back
    to a plain `preadv` where native AIO is unavailable (`polled` is then False).
    """

    def __init__(self) -> None:
        self._ctx = ctypes.c_ulong(0)
        calls = _AIO_SYSCALLS.get(platform.machine())
        self._calls = calls or (-1, -1, -1, -1)
        self._libc: Any = None
        self.polled = False
        if calls is not None and os.name == "posix":
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall.restype = ctypes.c_long
                if libc.syscall(self._calls[0], 1, ctypes.byref(self._ctx)) == 0:
                    self._libc, self.polled = libc, True
            except (OSError, AttributeError):
                pass

    def read(self, fd: int, view: memoryview, offset: int) -> int:
        """Read len(view) bytes at `offset` into `view` (a writable, aligned buffer), in `read_full`'s chunks;
        the bytes read."""
        return read_full(fd, view, offset, self._read_once if self.polled else _preadv)

    def _read_once(self, fd: int, view: memoryview, offset: int) -> int:
        """One AIO read of at most len(view) bytes; the bytes read."""
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
        # IOCB_CMD_PREAD
        iocb = _IOCB(opcode=0, fildes=fd, buf=address, nbytes=len(view), offset=offset)
        batch = (ctypes.POINTER(_IOCB) * 1)(ctypes.pointer(iocb))
        if self._libc.syscall(self._calls[3], self._ctx, 1, batch) != 1:
            errno = ctypes.get_errno()
            raise OSError(errno, f"io_submit failed: {os.strerror(errno)}")
        event, now = _IOEvent(), _Timespec(0, 0)
        while True:
            got = self._libc.syscall(self._calls[2], self._ctx, 0, 1, ctypes.byref(event), ctypes.byref(now))
            if got == 1:
                break
            if got < 0 and ctypes.get_errno() != errno_module.EINTR:
                errno = ctypes.get_errno()
                raise OSError(errno, f"io_getevents failed: {os.strerror(errno)}")
        if event.res < 0:
            raise OSError(-event.res, os.strerror(-event.res))
        return int(event.res)

    def close(self) -> None:
        if self.polled:
            self._libc.syscall(self._calls[1], self._ctx)
            self.polled = False


def _direct_flag() -> int:
    return getattr(os, "O_DIRECT", 0)


def open_direct(path: str | os.PathLike[str], flags: int) -> tuple[int, bool]:
    """Open with O_DIRECT where the filesystem allows it; else plainly. Returns (fd, direct)."""
    if _direct_flag():
        try:
            return os.open(path, flags | _direct_flag()), True
        except OSError:
            pass
    return os.open(path, flags), False


def drop_page_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


@contextmanager
def scratch_dir(directory: str | os.PathLike[str] | None = None) -> Iterator[Path]:
    """A private temporary directory under `directory` (default: the system temp dir), removed on exit."""
    base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    if not base.is_dir():
        raise ValueError(f"directory {str(base)!r} does not exist")
    path = Path(tempfile.mkdtemp(prefix="kvlab-offload-", dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
