"""What ``malleus-sim replay`` prints and draws: one table of the policies, the segments with
the largest stragglers, and a plot of every policy's throughput over the trace with its
events marked (matplotlib, Agg)."""
from __future__ import annotations

from pathlib import Path


def table(res: dict, top: int = 8) -> str:
    """The policies (samples/s, against static and healthy, switches, GPU-hours lost) and the
    ``top`` segments by their worst rate."""
    h = res["healthy_samples_per_s"]
    lines = [f"{res['problem']}: {res['num_gpus']} GPUs, {res['hours']:g} h, {res['rows']} trace "
             f"rows in {res['segments']} segments; healthy {h:.4g} samples/s "
             f"({res['samples_per_step']} per {res['step_s']:g} s step)",
             f"capacity bound {res['capacity_bound']:.4f} of healthy "
             f"({res['capacity_samples_per_s']:.4g} samples/s)",
             "",
             f"{'policy':<16}{'samples/s':>12}{'vs static':>11}{'vs healthy':>12}"
             f"{'switches':>10}{'GPU-h lost':>12}"]
    for name, p in res["policies"].items():
        lines.append(f"{name:<16}{p['samples_per_s']:>12.4g}{p['vs_static']:>11.3f}"
                     f"{p['vs_healthy']:>12.3f}{p['switches']:>10d}{p['gpu_hours_lost']:>12.1f}")
    slow = sorted((e for e in res["events"] if e["slow_gpus"]), key=lambda e: -e["worst_rate"])
    if slow:
        lines += ["", f"largest stragglers (of {len(slow)} segments with one):",
                  f"{'from s':>10}{'to s':>10}{'slow GPUs':>11}{'worst':>7}{'static step':>13}"
                  + (f"{'oracle step':>13}{'plan s':>8}" if "oracle_step_s" in slow[0] else "")]
        for e in slow[:top]:
            row = (f"{e['start_s']:>10.0f}{e['end_s']:>10.0f}{e['slow_gpus']:>11d}"
                   f"{e['worst_rate']:>7.2f}{e['static_step_s']:>13.4g}")
            if "oracle_step_s" in e:
                row += f"{e['oracle_step_s']:>13.4g}{e['planning_s']:>8.2f}"
            lines.append(row)
    return "\n".join(lines)


def plot(res: dict, path: str | Path) -> None:
    """Samples/s of every policy over the trace (hours), the healthy and capacity levels, and
    a band where some GPU is slow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for e in res["events"]:
        if e["slow_gpus"]:
            ax.axvspan(e["start_s"] / 3600, e["end_s"] / 3600, color="0.9", lw=0)
    for name, tl in res["timelines"].items():
        xs, ys = [], []
        for a, b, sps in tl:
            xs += [a / 3600, b / 3600]
            ys += [sps, sps]
        ax.plot(xs, ys, label=name, lw=1.2)
    ax.axhline(res["healthy_samples_per_s"], color="k", ls=":", lw=1, label="healthy")
    ax.axhline(res["capacity_samples_per_s"], color="tab:gray", ls="--", lw=1,
               label="capacity bound (mean)")
    ax.set_xlabel("hours since the job started")
    ax.set_ylabel("samples / s")
    ax.set_title(f"{res['problem']}: {res['num_gpus']} GPUs under the trace "
                 f"(grey: some GPU slow)")
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
