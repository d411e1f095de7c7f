"""Tests' tools for MalleusEngine's rank files (``malleus_ds/files/ckpt_format.py``): read and write a
raw rank file's header and data, and rewrite one in the older ``torch.save`` zip format (which
must still load)."""
from pathlib import Path

import torch

from malleus_ds.files.ckpt_format import RAW_MAGIC, raw_data_start


def read_raw(f: Path) -> tuple[dict, bytes]:
    """``(header, data bytes)`` of a raw rank file (the header loaded as plain data)."""
    b = Path(f).read_bytes()
    assert b[:len(RAW_MAGIC)] == RAW_MAGIC, f"{f} is not a raw rank file"
    n = int.from_bytes(b[len(RAW_MAGIC):len(RAW_MAGIC) + 8], "little")
    import io
    header = torch.load(io.BytesIO(b[len(RAW_MAGIC) + 8:len(RAW_MAGIC) + 8 + n]),
                        weights_only=True)
    return header, b[raw_data_start(n):]


def write_raw(f: Path, header: dict, data: bytes) -> None:
    """A raw rank file from ``header`` (anything ``torch.save`` takes: a test may poison it)."""
    import io
    hb = io.BytesIO()
    torch.save(header, hb)
    hb = hb.getvalue()
    start = raw_data_start(len(hb))
    head = RAW_MAGIC + len(hb).to_bytes(8, "little") + hb
    Path(f).write_bytes(head + bytes(start - len(head)) + data)


def to_zip(f: Path) -> None:
    """Rewrite a raw rank file as the older format: one ``torch.save`` zip of the same dict
    with the slices as tensors."""
    from malleus_ds.files.ckpt_format import RAW_DTYPES

    header, data = read_raw(f)
    buf = bytearray(data)
    slices = {}
    for (kind, name, lo, hi), (dt, off) in header.pop("index").items():
        t = torch.frombuffer(buf, dtype=RAW_DTYPES[dt], count=hi - lo, offset=off) \
            if hi > lo else torch.empty(0, dtype=RAW_DTYPES[dt])
        slices[(kind, name, lo, hi)] = t.clone()
    header.pop("data_bytes")
    torch.save(dict(header, slices=slices), f)
