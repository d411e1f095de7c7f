"""fileio: atomic writes, and rank files written from page-aligned memory through O_DIRECT with a
buffered fallback where the file system refuses it (malleus_ds/files/fileio.py)."""
import errno
import os

import pytest

from malleus_ds.files import fileio
from malleus_ds.files.fileio import DIRECT_ALIGN, aligned_buffer, atomic_write_chunks


def _chunks():
    a = aligned_buffer(10)                       # one block
    a[:10] = b"0123456789"
    b = aligned_buffer(3 * DIRECT_ALIGN + 1)     # rounded up to four blocks
    b[-5:] = b"tail!"
    return a, b


def test_aligned_buffers_are_whole_blocks_at_page_addresses():
    import ctypes

    for n in (0, 1, DIRECT_ALIGN, DIRECT_ALIGN + 1):
        m = aligned_buffer(n)
        assert len(m) == max(DIRECT_ALIGN, -(-n // DIRECT_ALIGN) * DIRECT_ALIGN)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        assert addr % DIRECT_ALIGN == 0 and m[:] == bytes(len(m))


def test_chunks_land_back_to_back_and_replace_the_file(tmp_path):
    a, b = _chunks()
    f = tmp_path / "rank.pt"
    f.write_bytes(b"old")
    atomic_write_chunks(f, [memoryview(a), memoryview(b)])
    assert f.read_bytes() == bytes(a) + bytes(b)
    assert [p.name for p in tmp_path.iterdir()] == ["rank.pt"]           # no temporary left


def test_o_direct_failing_at_open_or_write_falls_back_to_a_buffered_write(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this OS")
    a, b = _chunks()
    real_open, real_write = os.open, os.write
    seen = []

    def refusing_open(path, flags, *args):
        seen.append(bool(flags & os.O_DIRECT))
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(fileio.os, "open", refusing_open)
    f = tmp_path / "at_open.pt"
    assert atomic_write_chunks(f, [memoryview(a), memoryview(b)]) is False
    assert f.read_bytes() == bytes(a) + bytes(b) and seen[:2] == [True, False]

    direct_fds = set()

    def open_noting(path, flags, *args):
        fd = real_open(path, flags & ~os.O_DIRECT, *args)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)   # numbers reused
        return fd

    def refusing_write(fd, data):      # some file systems say something else than EINVAL
        if fd in direct_fds:
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_write(fd, data)

    monkeypatch.setattr(fileio.os, "open", open_noting)
    monkeypatch.setattr(fileio.os, "write", refusing_write)
    f = tmp_path / "at_write.pt"
    assert atomic_write_chunks(f, [memoryview(a), memoryview(b)]) is False
    assert f.read_bytes() == bytes(a) + bytes(b)


def test_unaligned_chunks_are_written_buffered_and_errors_leave_nothing(tmp_path, monkeypatch):
    f = tmp_path / "small.bin"
    assert atomic_write_chunks(f, [memoryview(b"abc"), memoryview(b"de")]) is False
    assert f.read_bytes() == b"abcde"

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fileio.os, "write", full)
    with pytest.raises(OSError, match="No space"):
        atomic_write_chunks(tmp_path / "new.bin", [memoryview(aligned_buffer(1))])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.bin"]
