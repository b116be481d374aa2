"""This machine's storage read rate, for the model's input term: a file written, flushed and dropped
from the page cache, then read back in large blocks as a data loader streams samples."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from paraloom.config.errors import UserError

READ_BANDWIDTH = "storage.read_bandwidth"  # bytes/s one node reads its training samples at
BLOCK = 8 << 20


def measure_read_rate(directory: str | Path | None = None, nbytes: int = 128 << 20) -> tuple[float, bool]:
    """(bytes a second read from a fresh file in `directory`, whether the page cache was dropped first).

    Where the kernel cannot be told to drop the file's pages (no posix_fadvise), the rate is the
    page cache's, an upper bound, and the second value says so.
    """
    where = Path(directory) if directory is not None else Path(tempfile.gettempdir())
    if not where.is_dir():
        raise UserError(f"--storage {str(where)!r} is not a directory")
    block = os.urandom(BLOCK)  # incompressible, so a compressing file system reads it all
    fd, name = tempfile.mkstemp(prefix="paraloom-read-", dir=where)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block)
        os.fsync(fd)
        dropped = hasattr(os, "posix_fadvise")
        if dropped:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        start, read = time.perf_counter(), 0
        while chunk := os.read(fd, BLOCK):
            read += len(chunk)
        return read / (time.perf_counter() - start), dropped
    except OSError as exc:
        raise UserError(f"cannot measure the read rate in {str(where)!r}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
        os.unlink(name)


def read_seconds(sample_bytes: float, global_batch: int, nodes: int, read_bandwidth: float | None) -> float:
    """Seconds a node spends reading its share of one step's samples (`sample_bytes` each, as stored),
    the step's samples spread over `nodes` that each read from their own storage."""
    if sample_bytes <= 0:
        return 0.0
    if read_bandwidth is None:
        raise UserError(f"samples of {sample_bytes:g} bytes to read need the profile's {READ_BANDWIDTH} "
                        "(bytes/s; `paraloom calibrate` measures it, or add it under constants)")
    return sample_bytes * global_batch / max(1, nodes) / read_bandwidth
