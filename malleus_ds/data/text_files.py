"""Where the text of ``data=text`` is, and how each kind of file is read into documents.

``data.path`` is one file or a folder:

- ``.jsonl``: one JSON object per line, the document in the field ``data.text_field``;
- ``.txt``: the whole file is one document, read line by line (each line with its break);
- ``.parquet``: one document per row, in the column ``data.text_field`` (needs pyarrow);
- a folder written by ``datasets``' ``Dataset.save_to_disk`` (``state.json`` + ``*.arrow``
  shards): one document per row of the column ``data.text_field``, shards in ``state.json``'s
  order (needs pyarrow; the ``datasets`` package itself is not needed);
- any other folder: its ``.jsonl``/``.txt``/``.parquet`` files, recursively, hidden ones
  skipped, in the sorted order of their relative paths (the same on every process).

Readers yield ``(text, bytes read)`` items (text None: nothing to tokenize, only progress), and
a bad record is a :class:`~malleus_ds.data.tokens.DataError` naming the file and its line or row.
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Iterator

from .tokens import DataError

#: file suffixes data=text reads (.parquet through pyarrow)
TEXT_SUFFIXES = (".jsonl", ".txt", ".parquet")
#: files read with pyarrow: parquet files and the .arrow shards of a datasets folder
TABLE_SUFFIXES = (".parquet", ".arrow")
#: formats it does not read directly, with how to turn them into .jsonl
OTHER_FORMATS = (".arrow", ".csv", ".json.gz", ".gz", ".zst", ".bz2", ".xz")
CONVERT_HINT = ("convert them to .jsonl first, e.g. with the datasets package: "
                "datasets.load_dataset('csv', data_files='FILE')['train'].to_json('train.jsonl')")
#: rows per pyarrow record batch read at a time
TABLE_BATCH = 1024


def text_files(path: str | os.PathLike) -> list[Path]:
    """The files of ``data.path``, in reading order. Raises :class:`DataError`."""
    p = Path(path)
    what = f"data.path={str(p)!r}"
    if p.is_file():
        if p.suffix == ".arrow":
            raise DataError(f"{what}: an .arrow file is read as a shard of a datasets folder; "
                            f"point data.path at the folder that holds its state.json "
                            f"(Dataset.save_to_disk(DIR) writes one)")
        if p.suffix not in TEXT_SUFFIXES:
            hint = f"; {CONVERT_HINT}" if p.suffix in OTHER_FORMATS else ""
            raise DataError(f"{what}: data=text reads {', '.join(TEXT_SUFFIXES)} files or a "
                            f"folder of them (or a datasets save_to_disk folder), got suffix "
                            f"{p.suffix!r}{hint}")
        files = [p]
    elif p.is_dir():
        files = _saved_dataset(p) if _is_saved(p) else _scan(p)
    else:
        raise DataError(f"{what}: no such file or folder (a relative path is resolved against "
                        f"the directory the run starts in)")
    if any(f.suffix in TABLE_SUFFIXES for f in files):
        need_pyarrow(what)
    return files


def _is_saved(p: Path) -> bool:
    if (p / "dataset_dict.json").is_file():
        try:
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits")
        except (OSError, ValueError, AttributeError):
            splits = None
        raise DataError(f"data.path={str(p)!r} is a datasets DatasetDict (splits {splits}); "
                        f"point data.path at one split's folder, e.g. {p / 'train'}")
    return (p / "state.json").is_file() and any(p.glob("*.arrow"))


def _saved_dataset(p: Path) -> list[Path]:
    """The shards of a ``Dataset.save_to_disk`` folder, in the order its state.json lists."""
    what = f"data.path={str(p)!r}"
    try:
        state = json.loads((p / "state.json").read_text())
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{what}: state.json does not list the dataset's files "
                        f"({type(e).__name__}: {e}); is this a Dataset.save_to_disk folder?") from None
    if state.get("_indices_data_files"):
        raise DataError(f"{what}: the saved dataset keeps a separate indices file (a select / "
                        f"shuffle not flattened); save it again after dataset.flatten_indices()")
    files = [p / n for n in names]
    missing = [n for n, f in zip(names, files) if not f.is_file()]
    if missing or not files:
        raise DataError(f"{what}: state.json lists {len(names)} shard(s), missing here: "
                        f"{missing[:3]}")
    return files


def _scan(p: Path) -> list[Path]:
    what = f"data.path={str(p)!r}"
    found, other = [], []
    for q in p.rglob("*"):
        rel = q.relative_to(p)
        if any(part.startswith(".") for part in rel.parts) or not q.is_file():
            continue
        if q.suffix in TEXT_SUFFIXES:
            found.append(q)
        elif q.suffix in OTHER_FORMATS or q.name.endswith(OTHER_FORMATS):
            other.append(rel.as_posix())
    if other:
        arrow = [o for o in other if o.endswith(".arrow")]
        hint = (f"a datasets folder is read when data.path points at it (the folder with "
                f"state.json, e.g. {p / Path(arrow[0]).parent})" if arrow else CONVERT_HINT)
        raise DataError(f"{what} holds {len(other)} file(s) data=text does not read "
                        f"({', '.join(sorted(other)[:3])}{', ...' if len(other) > 3 else ''}); "
                        f"it reads {', '.join(TEXT_SUFFIXES)} files: {hint}")
    if not found:
        raise DataError(f"{what} is a folder without {', '.join(TEXT_SUFFIXES)} files "
                        f"(searched recursively, hidden files skipped): no text to train on")
    return sorted(found, key=lambda q: q.relative_to(p).as_posix())


def need_pyarrow(what: str) -> None:
    try:
        importlib.import_module("pyarrow.parquet")
    except ImportError:
        raise DataError(f"{what}: reading .parquet files and datasets folders needs pyarrow, "
                        f"which is not installed: pip install pyarrow (or pip install -e "
                        f"'.[text]'), or convert the text to .jsonl") from None


def needs_field(files: list[Path]) -> bool:
    """Whether ``data.text_field`` picks the text (every format but .txt)."""
    return any(f.suffix != ".txt" for f in files)


# ---- readers -------------------------------------------------------------------------------


def where(root: Path, f: Path) -> str:
    if root.is_dir():
        return f"data.path={str(root)!r}: {f.relative_to(root).as_posix()}"
    return f"data.path={str(f)!r}:"


def read_texts(root: Path, f: Path, field: str) -> Iterator[tuple[str | None, int]]:
    """The items of one file (its reader by suffix)."""
    if f.suffix == ".jsonl":
        return jsonl_texts(root, f, field)
    if f.suffix in TABLE_SUFFIXES:
        return table_texts(root, f, field)
    return txt_lines(root, f)


def jsonl_texts(root: Path, f: Path, field: str) -> Iterator[tuple[str | None, int]]:
    """(text, bytes read) per line of a ``.jsonl`` file (text None for a blank line)."""
    at = where(root, f)
    with open(f, "rb") as fh:
        for ln, raw in enumerate(fh, 1):
            if not raw.strip():
                yield None, len(raw)
                continue
            try:
                rec = json.loads(raw)
            except UnicodeDecodeError as e:
                raise DataError(f"{at} line {ln} is not UTF-8 text ({e.reason} at byte "
                                f"{e.start})") from None
            except ValueError as e:
                raise DataError(f"{at} line {ln} is not valid JSON ({e}); a .jsonl file "
                                f"holds one JSON object per line") from None
            if not isinstance(rec, dict):
                raise DataError(f"{at} line {ln} is a JSON {type(rec).__name__}, not an "
                                f"object with a {field!r} field")
            if field not in rec:
                keys = sorted(rec)
                raise DataError(f"{at} line {ln} has no field {field!r} (its fields: "
                                f"{keys[:8]}{' ...' if len(keys) > 8 else ''}); set "
                                f"data.text_field=NAME to the field that holds the text")
            text = rec[field]
            if not isinstance(text, str):
                raise DataError(f"{at} line {ln}: field {field!r} holds a "
                                f"{type(text).__name__}, not a string")
            yield text, len(raw)


def txt_lines(root: Path, f: Path) -> Iterator[tuple[str, int]]:
    """(line with its line break, bytes read) of a ``.txt`` file."""
    with open(f, "rb") as fh:
        for ln, raw in enumerate(fh, 1):
            try:
                yield raw.decode("utf-8"), len(raw)
            except UnicodeDecodeError as e:
                raise DataError(f"{where(root, f)} line {ln} is not UTF-8 text ({e.reason} at "
                                f"byte {e.start})") from None


def table_texts(root: Path, f: Path, field: str) -> Iterator[tuple[str | None, int]]:
    """(text, bytes) per row of a ``.parquet`` file or a datasets ``.arrow`` shard (an Arrow
    IPC stream), reading only the text column, a record batch at a time. The file's bytes are
    spread over its batches by rows (the progress bar's unit)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    at = where(root, f)
    size = f.stat().st_size
    kind = "parquet" if f.suffix == ".parquet" else "Arrow stream (datasets shard)"
    mm = None
    try:
        if f.suffix == ".parquet":
            src = pq.ParquetFile(f)
            schema, rows = src.schema_arrow, src.metadata.num_rows
        else:
            mm = pa.memory_map(str(f))
            src = pa.ipc.open_stream(mm)
            schema, rows = src.schema, None
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{at} is not a readable {kind} file ({e})") from None
    if field not in schema.names:
        raise DataError(f"{at} has no column {field!r} (its columns: {schema.names[:8]}"
                        f"{' ...' if len(schema.names) > 8 else ''}); set data.text_field=NAME "
                        f"to the column that holds the text")
    typ = schema.field(field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
            or getattr(pa.types, "is_string_view", lambda t: False)(typ)):
        raise DataError(f"{at} column {field!r} holds {typ}, not strings")
    batches = (src.iter_batches(batch_size=TABLE_BATCH, columns=[field])
               if f.suffix == ".parquet" else src)
    row = done = 0
    try:
        for b in batches:
            for text in b.column(b.schema.get_field_index(field)).to_pylist():
                row += 1
                if text is None:
                    raise DataError(f"{at} row {row}: column {field!r} is null (drop such rows "
                                    f"or fill them before training)")
                yield text, 0
            now = min(size, mm.tell() if mm is not None else size * row // max(1, rows))
            yield None, now - done
            done = now
    except pa.ArrowException as e:
        raise DataError(f"{at} is not a readable {kind} file at row {row + 1} ({e})") from None
    finally:
        if mm is not None:
            mm.close()
    yield None, size - done
