"""``malleus_ds/emulation/cpu_quota.py``: quota arithmetic, v1/v2 paths against a fake cgroup tree, stale
folder cleanup, error texts; and one real test (skipped, naming why, where no cpu controller can
be written): a child process capped at rate 3 runs 2.4-3.6x slower than alone on a full core (its
CPU time), is back within 1.3x of its uncapped time after ``set_rate(1.0)``, and ``close()``
leaves no cgroup folder."""
from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest

from malleus_ds.emulation import cpu_quota as cq
from malleus_ds.emulation.cpu_quota import CpuQuota, CpuQuotaError, clean_stale, detect, quota_us


def test_quota_arithmetic():
    assert quota_us(1.0, 50_000) is None                     # no limit
    assert quota_us(2, 50_000) == 25_000
    assert quota_us(3.0, 100_000) == 33_333
    assert quota_us(50.0, 50_000) == 1_000                   # the kernel's minimum
    with pytest.raises(ValueError, match=r"rate=60.0 needs a quota of 833 us per 50000 us "
                                         r"period, below the kernel's minimum of 1000 us; "
                                         r"the largest rate is 50"):
        quota_us(60.0, 50_000)
    for bad in (0.5, float("inf"), float("nan"), True, "3"):
        with pytest.raises(ValueError, match=r"must be a finite number >= 1.0"):
            quota_us(bad, 50_000)


def _v1_tree(tmp_path: Path, own: str = "/", name: str = "cpu") -> tuple[Path, Path]:
    root = tmp_path / name
    root.mkdir(parents=True)
    (root / "cpu.cfs_quota_us").write_text("-1")
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"9:name=systemd:/\n4:memory:/x/y\n1:{name}:{own}\n0::/\n")
    return root, proc


def _v2_tree(tmp_path: Path, own: str, own_ctl: str, root_ctl: str) -> tuple[Path, Path]:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids")
    (tmp_path / "cgroup.subtree_control").write_text(root_ctl)
    d = tmp_path.joinpath(*own.strip("/").split("/"))
    d.mkdir(parents=True)
    (d / "cgroup.subtree_control").write_text(own_ctl)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::{own}\n")
    return d, proc


def test_detect_v1_v2_none(tmp_path):
    root, proc = _v1_tree(tmp_path / "a", "/job/1")
    lay = detect(str(tmp_path / "a"), str(proc))
    assert (lay.version, lay.root, lay.original, lay.parents) == (1, root, root / "job" / "1",
                                                                   (root,))
    root, proc = _v1_tree(tmp_path / "b", "/", name="cpu,cpuacct")
    lay = detect(str(tmp_path / "b"), str(proc))
    assert lay.version == 1 and lay.original == root
    (tmp_path / "c").mkdir()
    own, proc = _v2_tree(tmp_path / "c", "/user.slice/s1", "", "cpu")
    lay = detect(str(tmp_path / "c"), str(proc))
    assert (lay.version, lay.original, lay.parents) == (2, own, (own, tmp_path / "c"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "cgroup.controllers").write_text("memory pids")     # v2 without cpu
    assert detect(str(tmp_path / "d"), str(proc)) is None


def test_v1_quota_files_and_close(tmp_path):
    root, proc = _v1_tree(tmp_path, "/orig")
    (root / "orig").mkdir()
    q = CpuQuota(str(tmp_path), str(proc), period_us=50_000, pid=4242)
    d = root / "malleus-4242"
    assert q.path == d and (d / "cgroup.procs").read_text() == "4242"
    assert (d / "cpu.cfs_quota_us").read_text() == "-1"
    q.set_rate(4.0)
    assert (d / "cpu.cfs_period_us").read_text() == "50000"
    assert (d / "cpu.cfs_quota_us").read_text() == "12500" and q.rate == 4.0
    q.set_rate(1.0)
    assert (d / "cpu.cfs_quota_us").read_text() == "-1"
    q.close()
    assert (root / "orig" / "cgroup.procs").read_text() == "4242"   # back where it was
    assert q.path is None
    q.close()                                                      # idempotent
    with pytest.raises(CpuQuotaError, match="set_rate after close"):
        q.set_rate(2.0)


@pytest.mark.parametrize("own_ctl,root_ctl,where", [("cpu memory", "cpu", "own"),
                                                   ("", "cpu io", "root")])
def test_v2_child_of_own_cgroup_if_delegated_else_of_root(tmp_path, own_ctl, root_ctl, where):
    own, proc = _v2_tree(tmp_path, "/user.slice/job", own_ctl, root_ctl)
    q = CpuQuota(str(tmp_path), str(proc), period_us=40_000, pid=77)
    d = (own if where == "own" else tmp_path) / "malleus-77"
    assert q.path == d and (d / "cgroup.procs").read_text() == "77"
    assert (d / "cpu.max").read_text() == "max 40000"
    q.set_rate(2.0)
    assert (d / "cpu.max").read_text() == "20000 40000"
    q.close()
    assert (own / "cgroup.procs").read_text() == "77"


def test_v2_without_delegation_anywhere_is_an_error(tmp_path):
    _, proc = _v2_tree(tmp_path, "/a", "", "")
    with pytest.raises(CpuQuotaError, match=r"'cpu' not enabled in cgroup.subtree_control"):
        CpuQuota(str(tmp_path), str(proc), pid=5)
    assert "cgroup.subtree_control does not enable 'cpu'" in cq.unavailable_reason(
        str(tmp_path), str(proc))


def test_stale_dirs_of_dead_processes_are_removed(tmp_path):
    for pid in (11, 12, 13):
        (tmp_path / f"malleus-{pid}").mkdir()
    (tmp_path / "malleus-13" / "cgroup.procs").write_text("13")   # still holds a process
    (tmp_path / "other-11").mkdir()
    gone = clean_stale(tmp_path, alive=lambda pid: pid == 12)
    assert gone == [tmp_path / "malleus-11"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["malleus-12", "malleus-13", "other-11"]
    # creating a quota cleans its parent first
    root, proc = _v1_tree(tmp_path / "t")
    (root / f"malleus-{2**22 + 12345}").mkdir()                  # a pid above pid_max: dead
    q = CpuQuota(str(tmp_path / "t"), str(proc), pid=9)
    assert not (root / f"malleus-{2**22 + 12345}").exists() and q.path == root / "malleus-9"
    q.close()


def test_unavailable_reasons_name_the_cause(tmp_path, monkeypatch):
    assert cq.unavailable_reason(str(tmp_path), str(tmp_path / "none")) == (
        f"no cgroup cpu controller is mounted (looked for {tmp_path}/cpu/cpu.cfs_quota_us "
        f"(cgroup v1) and 'cpu' in {tmp_path}/cgroup.controllers (cgroup v2))")
    root, proc = _v1_tree(tmp_path)
    assert cq.unavailable_reason(str(tmp_path), str(proc)) is None
    assert list(root.glob("malleus-probe-*")) == []             # the probe is removed

    def read_only(self, *a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert cq.unavailable_reason(str(tmp_path), str(proc)) == (
        f"cannot create a cgroup under {root} (cgroup v1): EROFS Read-only file system "
        f"(uid {os.getuid()})")
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cq.unavailable_reason() == "CPU quotas need Linux cgroups; this is darwin"
    with pytest.raises(ValueError, match=r"period_us=500 must be in \[1000, 1000000\]"):
        CpuQuota(str(tmp_path), str(proc), period_us=500)


# -- the real thing ---------------------------------------------------------------------------


