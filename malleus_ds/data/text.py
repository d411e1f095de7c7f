"""Raw text, tokenized with the model's own tokenizer (``data=text``).

Someone fine-tuning a Hugging Face model brings a folder of text and the model's tokenizer, not
token ids. ``data.path`` names the text: a ``.jsonl``, ``.txt`` or ``.parquet`` file, a
``datasets`` save_to_disk folder, or a folder of such files (:mod:`malleus_ds.data.text_files`
lists and reads them, in the same order on every process). The tokenizer is the model folder's
own (``model=hf_local``) or ``data.tokenizer=DIR``, loaded with
``transformers.AutoTokenizer.from_pretrained(DIR, local_files_only=True)``: nothing is fetched.

How text becomes tokens (as Hugging Face's ``run_clm`` example: concatenate everything, then
cut windows):

- a document is one ``.jsonl`` record's or one table row's text (``data.text_field``), or one
  whole ``.txt`` file;
- its tokens are what the tokenizer's own call gives, special tokens included (Llama-style
  tokenizers put BOS first, GPT-2-style ones nothing), then EOS unless the tokenizer already
  ends with it: documents are joined by EOS;
- a ``.txt`` file is tokenized line by line, each line with its line break (as ``datasets``'
  text loader and ``run_clm`` with ``keep_linebreaks``), so a big file never sits in the
  tokenizer whole; records with empty text and empty files are skipped;
- all documents are concatenated in file order into one token file, which
  :class:`~malleus_ds.data.tokens.TokenDataset` reads as for ``data=tokens``: windows of
  ``seq_len + 1`` tokens, one every ``seq_len // 2``, in a permutation seeded by
  ``train.data_seed``. Sample ``i`` is a pure function of ``i``: every engine and plan sees the
  same batches, and a resumed run continues at the same position.

Tokenizing runs once: the token file is cached (:mod:`malleus_ds.data.token_cache`) under a key
made of the content hashes of the text files and of the tokenizer files, in
``<data.path>.malleus-tokens/`` or ``data.cache_dir``. A second run reuses it, changed text or
a changed tokenizer gets another key (a new build); many processes starting at once build it
once (a file lock) and all memory-map the same file.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from .text_files import needs_field, read_texts, text_files
from .token_cache import get_or_build, lookup, say
from .tokens import DataError, inspect_token_file

#: tokenizer files that decide what ids a text gets (the cache key hashes those present;
#: model weights in the same folder are never read)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt")
#: the rule that turns text into tokens (part of the cache key: a new rule, a new key)
FORMAT = "malleus-text-1: tokenizer(doc) + eos; .txt per line; empty skipped"
#: a batch handed to the tokenizer at once: this many documents / lines, or this many chars
BATCH_ITEMS = 1024
BATCH_CHARS = 1 << 20
#: bytes per read when hashing files
HASH_CHUNK = 8 * 1024 * 1024
#: the default cache folder: beside data.path, its name plus this
CACHE_SUFFIX = ".malleus-tokens"


@dataclass(frozen=True)
class TextTokens:
    """The token file of a text corpus, ready to memory-map."""

    path: Path                  # the cached .npy
    num_tokens: int
    documents: int
    files: int
    key: str
    vocab: int                  # ids the tokenizer can give (len(tokenizer), at least)
    tokenizer: Path             # the tokenizer folder
    built: bool                 # tokenized by this process (False: found in the cache)


# ---- where the text and the tokenizer are -------------------------------------------------


def tokenizer_dir(tokenizer: str | None, model) -> tuple[Path, str]:
    """(the tokenizer folder, how messages name it): ``data.tokenizer`` when set, else the
    model's own folder (``model=hf_local model.hf_path=DIR``). Raises :class:`DataError` when
    there is none or it holds no tokenizer file."""
    if tokenizer is not None:
        d, src = Path(tokenizer), f"data.tokenizer={tokenizer}"
        if not d.is_dir():
            raise DataError(f"{src}: no such folder (a tokenizer folder: tokenizer.json + "
                            f"tokenizer_config.json, as tokenizer.save_pretrained(DIR) writes)")
    else:
        path = getattr(model, "path", None)
        if path is None:
            name = getattr(model, "name", "?")
            raise DataError(f"data=text needs a tokenizer: model={name} brings none (only "
                            f"model=hf_local model.hf_path=DIR uses its folder's tokenizer); set "
                            f"data.tokenizer=DIR, a folder with tokenizer.json + "
                            f"tokenizer_config.json (tokenizer.save_pretrained(DIR) writes one)")
        d, src = Path(path), f"model.hf_path={path}"
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        fix = ("" if tokenizer is not None else
               "; copy the model's tokenizer files there, or set data.tokenizer=DIR")
        raise DataError(f"{src}: no tokenizer files there (looked for "
                        f"{', '.join(TOKENIZER_FILES[:2])}, ...){fix}")
    return d, src


def load_tokenizer(d: Path, src: str):
    """``AutoTokenizer.from_pretrained(d, local_files_only=True)``; nothing is downloaded."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; say which
        raise DataError(f"{src}: cannot load the tokenizer ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    tok.model_max_length = int(1e30)      # whole documents: no "longer than max length" warning
    return tok


def vocab_of(tok) -> int:
    """Ids the tokenizer can give: ``len(tokenizer)`` (added tokens included), or one past its
    highest id when its ids have gaps."""
    try:
        top = max(tok.get_vocab().values(), default=-1)
    except (AttributeError, NotImplementedError):
        top = -1
    return max(len(tok), top + 1)


def check_vocab(vocab: int, vocab_size: int, src: str) -> None:
    if vocab > vocab_size:
        raise DataError(f"{src}: the tokenizer has {vocab} tokens (len(tokenizer), added tokens "
                        f"included) but model.vocab_size={vocab_size}: its ids up to {vocab - 1} "
                        f"would index past the embedding; use the model's own tokenizer, or a "
                        f"model with vocab_size >= {vocab}")


def special_frame(tok, src: str) -> tuple[list[int], list[int]]:
    """(tokens the tokenizer puts before a text, tokens after it plus EOS): a document is
    ``prefix + tokenizer(text, add_special_tokens=False) + suffix``, which is the tokenizer's own
    ``tokenizer(text)`` followed by EOS, found once by encoding a probe both ways."""
    eos = tok.eos_token_id
    if eos is None:
        raise DataError(f"{src}: the tokenizer has no eos_token, and data=text joins documents "
                        f"with it; set \"eos_token\" in its tokenizer_config.json")
    probe = "a b"
    full = list(tok(probe)["input_ids"])
    bare = list(tok(probe, add_special_tokens=False)["input_ids"])
    prefix, suffix = [], []
    for k in range(len(full) - len(bare) + 1):
        if full[k:k + len(bare)] == bare:
            prefix, suffix = full[:k], full[k + len(bare):]
            break
    if not suffix or suffix[-1] != eos:
        suffix = suffix + [int(eos)]
    return [int(i) for i in prefix], [int(i) for i in suffix]


# ---- content hashes: the cache key ---------------------------------------------------------


def file_digest(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def tokenizer_digest(d: Path) -> str:
    """The tokenizer files' content hash (names and bytes of those present)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        f = d / name
        if f.is_file():
            h.update(f"{name}\0{file_digest(f)}\0".encode())
    return h.hexdigest()


def cache_key(root: Path, files: list[Path], text_field: str, tok_digest: str) -> tuple[str, list]:
    """(key, the files' record): a hash of the rule, every file's relative name, size and
    content hash, the text field (unless all are ``.txt``) and the tokenizer's hash."""
    base = root if root.is_dir() else root.parent
    rec = [{"name": f.relative_to(base).as_posix(), "bytes": f.stat().st_size,
            "sha256": file_digest(f)} for f in files]
    material = {"format": FORMAT, "files": [[r["name"], r["bytes"], r["sha256"]] for r in rec],
                "text_field": text_field if needs_field(files) else None,
                "tokenizer": tok_digest}
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    return key, rec


def default_cache_dir(path: str | os.PathLike) -> Path:
    """``<data.path>.malleus-tokens``: beside the file or folder of text."""
    p = Path(os.path.abspath(path))
    return p.with_name(p.name + CACHE_SUFFIX)


# ---- reading and tokenizing ------------------------------------------------------------------


def _batches(items: Iterator[tuple[str | None, int]]) -> Iterator[tuple[list[str], int]]:
    """Items grouped for one tokenizer call: (non-empty texts, bytes those items read)."""
    texts: list[str] = []
    chars = nbytes = 0
    for text, n in items:
        nbytes += n
        if text:
            texts.append(text)
            chars += len(text)
        if len(texts) >= BATCH_ITEMS or chars >= BATCH_CHARS:
            yield texts, nbytes
            texts, chars, nbytes = [], 0, 0
    if texts or nbytes:
        yield texts, nbytes


class _Sink:
    """Token ids appended to the cache's raw file, counted, their highest id kept."""

    def __init__(self, f: BinaryIO, dtype: np.dtype) -> None:
        self.f, self.dtype, self.tokens, self.top = f, np.dtype(dtype), 0, -1

    def write(self, parts: list[list[int]]) -> None:
        a = np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64)
        if not a.size:
            return
        self.top = max(self.top, int(a.max()))
        if self.top > np.iinfo(self.dtype).max or int(a.min()) < 0:
            raise RuntimeError(f"the tokenizer gave id {self.top}, outside {self.dtype.name}")
        a.astype(self.dtype).tofile(self.f)
        self.tokens += int(a.size)


def tokenize(f: BinaryIO, tok, frame: tuple[list[int], list[int]], root: Path,
             files: list[Path], field: str, dtype: np.dtype, *, progress: bool = True) -> dict:
    """Write the corpus' tokens to ``f`` (raw ids of ``dtype``); returns the counts. A tqdm bar
    (bytes of text read) shows the progress."""
    from tqdm import tqdm

    prefix, suffix = frame
    sink = _Sink(f, dtype)
    docs = 0
    total = sum(p.stat().st_size for p in files)

    def encode(texts: list[str]) -> list[list[int]]:
        return tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    with tqdm(total=total, unit="B", unit_scale=True, desc="[malleus_ds] data: tokenizing",
              file=sys.stderr, mininterval=1.0, disable=not progress, leave=True) as bar:
        for p in files:
            if p.suffix != ".txt":                     # a document per record / row
                for texts, nbytes in _batches(read_texts(root, p, field)):
                    parts: list[list[int]] = []
                    for ids in encode(texts):
                        parts += (prefix, ids, suffix)
                    sink.write(parts)
                    docs += len(texts)
                    bar.update(nbytes)
            else:
                started = False
                for texts, nbytes in _batches(read_texts(root, p, field)):
                    if texts and not started:
                        sink.write([prefix])
                        started = True
                    sink.write(encode(texts))
                    bar.update(nbytes)
                if started:
                    sink.write([suffix])
                    docs += 1
    if sink.tokens == 0:
        raise DataError(f"data.path={str(root)!r}: no text to train on: {len(files)} file(s), "
                        f"{total} bytes, 0 non-empty documents (records and rows with an "
                        f"empty {field!r} and empty files are skipped)")
    return {"tokens": sink.tokens, "documents": docs, "max_id": sink.top}


def prepare_text(path: str | os.PathLike, *, text_field: str, tokenizer: str | os.PathLike,
                 tokenizer_src: str, cache_dir: str | os.PathLike, vocab_size: int,
                 progress: bool = True) -> TextTokens:
    """The token file of the text at ``path`` tokenized by the tokenizer folder ``tokenizer``
    (``tokenizer_src``: how messages name it): found in ``cache_dir`` under its content key, or
    built there now (once, under a file lock). Checks the tokenizer's vocabulary against
    ``vocab_size`` first. Raises :class:`DataError` naming the file and the numbers."""
    root = Path(path)
    files = text_files(root)
    tok_dir = Path(tokenizer)
    what = f"data.path={str(root)!r}"
    total = sum(f.stat().st_size for f in files)
    if total == 0:
        raise DataError(f"{what}: no text to train on: {len(files)} file(s), all empty")
    key, file_rec = cache_key(root, files, text_field, tokenizer_digest(tok_dir))
    folder = Path(cache_dir)
    entry = lookup(folder, key)
    if entry is not None:                   # no tokenizer load, no transformers import
        check_vocab(int(entry.meta["vocab"]), vocab_size, tokenizer_src)
    else:
        tok = load_tokenizer(tok_dir, tokenizer_src)
        vocab = vocab_of(tok)
        check_vocab(vocab, vocab_size, tokenizer_src)
        frame = special_frame(tok, tokenizer_src)
        dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)

        def build(f: BinaryIO) -> dict:
            say(f"tokenizing {len(files)} file(s), {total} bytes, with {tokenizer_src} "
                f"(vocabulary {vocab}) into {folder}", always=True)
            t0 = time.monotonic()
            counts = tokenize(f, tok, frame, root, files, text_field, dtype, progress=progress)
            return {**counts, "vocab": vocab, "files": file_rec, "text_field": text_field,
                    "path": str(root), "tokenizer": str(tok_dir), "format": FORMAT,
                    "prefix": frame[0], "suffix": frame[1], "seconds": time.monotonic() - t0}

        entry = get_or_build(folder, key, dtype, build, what=what, announce=say)
    meta = entry.meta
    if int(meta["max_id"]) >= vocab_size:   # a tokenizer whose ids outrun len(tokenizer)
        raise DataError(f"{tokenizer_src}: the text's tokens reach id {meta['max_id']} >= "
                        f"model.vocab_size={vocab_size}")
    n = inspect_token_file(entry.path).num_tokens
    if n != int(meta["tokens"]):
        raise DataError(f"token cache {entry.path} holds {n} tokens, its record "
                        f"{int(meta['tokens'])}: delete it to rebuild")
    if not entry.built:
        say(f"{meta['documents']} documents, {n} tokens from the token cache {entry.path}")
    return TextTokens(entry.path, n, int(meta["documents"]), len(files), key, int(meta["vocab"]),
                      tok_dir, entry.built)
