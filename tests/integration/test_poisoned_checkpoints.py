"""Loading never runs code (issue 22): a checkpoint file that names a function -- here
``os.system``, which would create a marker file -- is refused with a clear error on every rank by
resume (same plan, another world size), by ``malleus-export``, for every engine; nothing runs,
nothing trains, and the checkpoint folder is left byte for byte as it was. Truncated files,
files of another save and a non-checkpoint ``.pt`` get a clear error too (the resume path's
error agreement is the one the poisoned files go through). The checkpoints are written once, by
one 2-rank run of the app's config per engine (tests/integration/app_run.py); every resume is a
``launch/train.py`` launch."""
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from malleus_ds.export.hf_folder import ExportError
from malleus_ds.files.ckpt_format import RAW_MAGIC
from malleus_ds.export.readers import read_malleus, read_torch
from tests.integration.app_run import run_app
from tests.rank_files import read_raw, to_zip, write_raw

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
#: a Llama record for the export readers (the files hold model=tiny; the readers fail first)
RECORD = {"config": {"model_type": "llama", "tie_word_embeddings": False}}
TINY = ["model=tiny", "model.max_seq_len=16", "progress=false", "train.global_batch_size=4"]


class _Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _train(tmp: Path, name: str, *over: str, nproc: int = 2, steps: int = 2, check=True):
    cmd = [sys.executable, TRAIN, *TINY, f"nproc_per_node={nproc}", f"train.steps={steps}",
           f"hydra.run.dir={tmp / ('run_' + name)}", *over]
    p = subprocess.run(cmd, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=240)
    if check:
        assert p.returncode == 0, p.stderr[-3000:]
    return p


def _digest(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def _poison(f: Path, marker: Path) -> None:
    """Our own file, plus one key holding an object that runs a command when unpickled (in a
    raw rank file: in its header)."""
    if f.read_bytes()[:len(RAW_MAGIC)] == RAW_MAGIC:
        header, data = read_raw(f)
        write_raw(f, dict(header, extra=_Payload(marker)), data)
        return
    ck = torch.load(f, weights_only=True)
    ck["extra"] = _Payload(marker)
    torch.save(ck, f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One checkpoint per engine, after 2 steps: the app's config for each (the overrides
    :func:`_train` passes) run one after another by one 2-rank harness run (only the resumes
    need the CLI; engine=torch saves one file whatever the world size)."""
    tmp = tmp_path_factory.mktemp("saved")
    # engine=deepspeed first: after an engine=malleus run in the same process, DeepSpeed's
    # engine finds a data-parallel world of 1 (process-group state in module globals)
    run_app(2, *[([*TINY, f"engine={eng}", "train.steps=2", f"checkpoint.dir={tmp / eng}",
                   *(["malleus.adaptive=false"] if eng == "malleus" else [])], None)
                 for eng in ("deepspeed", "torch", "malleus")])
    for eng in ("malleus", "deepspeed", "torch"):
        assert (tmp / eng / "latest").read_text() == "global_step2", eng
    return tmp


def _copy(saved: Path, eng: str, tmp: Path) -> Path:
    ck = tmp / f"ck_{eng}"
    shutil.copytree(saved / eng, ck)
    return ck


def _refused_by_resume(tmp, ck, eng, marker, *over, nproc=2, expect="refused"):
    before = _digest(ck)
    extra = ["malleus.adaptive=false"] if eng == "malleus" else []
    p = _train(tmp, f"resume_{eng}_{nproc}", f"engine={eng}", f"checkpoint.dir={ck}",
               "checkpoint.resume=true", *extra, *over, nproc=nproc, steps=4, check=False)
    assert p.returncode != 0, p.stdout[-2000:]
    assert not marker.exists(), "loading ran the payload"
    assert _digest(ck) == before, "the checkpoint folder changed"
    errs = [ln for ln in p.stderr.splitlines() if "config error (rank" in ln]
    assert len(errs) == nproc and all(expect in e for e in errs), p.stderr[-4000:]
    assert "== malleus_ds run" not in p.stdout     # no summary: it never trained
    return errs[0]


@pytest.mark.slow
def test_malleus_rank_file_is_refused_by_resume_any_world_and_export(saved, tmp_path):

    marker = tmp_path / "PWNED"
    ck = _copy(saved, "malleus", tmp_path)
    victim = ck / "global_step2" / "malleus_rank00001.pt"
    _poison(victim, marker)
    err = _refused_by_resume(tmp_path, ck, "malleus", marker)
    assert f"{victim}: refused: this MalleusEngine checkpoint file is not plain data (it names " \
           f"posix.system" in err
    # another world size (one process) reads rank 1's file too: refused the same way
    _refused_by_resume(tmp_path, ck, "malleus", marker, nproc=1)
    # malleus-export's reader of these files (the model check before it wants an HF model)
    before = _digest(ck)
    with pytest.raises(ExportError, match=r"malleus_rank00001.pt: refused: .*posix.system"):
        read_malleus(ck / "global_step2", RECORD)
    assert not marker.exists() and _digest(ck) == before


@pytest.mark.slow
def test_torch_and_deepspeed_files_are_refused_by_resume(saved, tmp_path):
    marker = tmp_path / "PWNED"
    ck = _copy(saved, "torch", tmp_path)
    f = next((ck / "global_step2").glob("*.pt"))
    _poison(f, marker)
    _refused_by_resume(tmp_path, ck, "torch", marker, nproc=1)
    with pytest.raises(ExportError, match=r"refused: .*posix.system"):
        read_torch(ck / "global_step2", RECORD, 2)
    assert not marker.exists()
    ck = _copy(saved, "deepspeed", tmp_path)
    optim = sorted((ck / "global_step2").glob("*optim_states.pt"))[-1]
    # DeepSpeed's own file names its loss scaler: poison it with something else as well
    from malleus_ds.interop.compat import load_deepspeed_file

    ck_obj = load_deepspeed_file(optim, "cpu")      # weights-only, DeepSpeed's value classes
    ck_obj["extra"] = _Payload(marker)
    torch.save(ck_obj, optim)
    err = _refused_by_resume(tmp_path, ck, "deepspeed", marker)
    assert "posix.system" in err and optim.name in err, err


def test_damaged_files_get_clear_errors(saved, tmp_path):
    """Truncated, from another save, not a checkpoint at all: each named, with what to do."""
    from malleus_ds.files.ckpt_format import CheckpointError, open_rank_file, resolve

    ck = _copy(saved, "malleus", tmp_path)
    d, meta = resolve(ck)
    f = d / "malleus_rank00000.pt"
    good = f.read_bytes()
    header, data = read_raw(f)
    to_zip(f)
    good_zip = f.read_bytes()                           # the older format: still checked
    other = torch.load(f, weights_only=True)
    other["save_id"] += 1
    for name, write, expect in [
            ("truncated", lambda: f.write_bytes(good[: len(good) // 2]),
             "a raw rank file of .* bytes with .* data bytes after byte .*truncated or corrupted"),
            ("header cut", lambda: f.write_bytes(good[:100]),
             "claiming a .*-byte header: the .* is truncated or corrupted"),
            ("slice beyond the data", lambda: write_raw(f, dict(header, index={
                k: (dt, off + len(data)) for k, (dt, off) in header["index"].items()}), data),
             "at an offset within the file's .* data bytes"),
            ("unknown dtype", lambda: write_raw(f, dict(header, index={
                k: ("int8", off) for k, (dt, off) in header["index"].items()}), data),
             "is not one of .*bfloat16.* at an offset"),
            ("raw, other save", lambda: write_raw(f, dict(header, save_id=header["save_id"] + 1),
                                                  data), "written by another save"),
            ("raw, object in the engine state", lambda: write_raw(f, dict(header, engine=[1]),
                                                                  data), "not a well-formed"),
            ("zip truncated", lambda: f.write_bytes(good_zip[: len(good_zip) // 2]),
             "not a complete torch.save zip archive"),
            ("zip, other save", lambda: torch.save(other, f), "written by another save"),
            ("not a checkpoint", lambda: torch.save({"weights": torch.zeros(3)}, f),
             "not a malleus-checkpoint-v1 file of rank 0"),
            ("zip, object in the engine state",
             lambda: torch.save(dict(other, save_id=meta["save_id"], engine=[1]), f),
             "not a well-formed")]:
        write()
        with pytest.raises(CheckpointError, match=expect) as e:
            open_rank_file(d, 0, meta)
        assert str(f) in str(e.value) and ("copy" in str(e.value) or "another" in str(e.value)), \
            (name, e.value)
        f.write_bytes(good)
    f.write_bytes(good_zip)
    open_rank_file(d, 0, meta)                                     # the older format loads
    f.write_bytes(good)
    open_rank_file(d, 0, meta)                                     # the good file still loads
