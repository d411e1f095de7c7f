"""What ``malleus-sim replay`` prints and draws: one table of the policies, the segments with
the largest stragglers, and a plot of every policy's throughput over the trace with its
events marked (matplotlib, Agg)."""
from __future__ import annotations

from pathlib import Path


def table(res: dict, top: int = 8) -> str:
    """The policies (samples/s, against static and healthy, share of the oracle's gain,
    switches, GPU-hours lost), the ``top`` segments by their worst rate, the re-planning
    policies' events and the break-even durations."""
    h = res["healthy_samples_per_s"]
    lines = [f"{res['problem']}: {res['num_gpus']} GPUs, {res['hours']:g} h, {res['rows']} trace "
             f"rows in {res['segments']} segments; healthy {h:.4g} samples/s "
             f"({res['samples_per_step']} per {res['step_s']:g} s step)",
             f"capacity bound {res['capacity_bound']:.4f} of healthy "
             f"({res['capacity_samples_per_s']:.4g} samples/s)",
             "",
             f"{'policy':<16}{'samples/s':>12}{'vs static':>11}{'vs healthy':>12}"
             f"{'of oracle':>11}{'switches':>10}{'paused s':>10}{'GPU-h lost':>12}"]
    for name, p in res["policies"].items():
        og = p.get("of_oracle_gain")
        lines.append(f"{name:<16}{p['samples_per_s']:>12.4g}{p['vs_static']:>11.3f}"
                     f"{p['vs_healthy']:>12.3f}{'' if og is None else f'{og:.3f}':>11}"
                     f"{p['switches']:>10d}{p['migration_s']:>10.0f}"
                     f"{p['gpu_hours_lost']:>12.1f}")
    if "malleus" in res["policies"]:
        m = res["policies"]["malleus"]
        lines.append(f"(malleus: {m['steps']} steps, {m['stepped_steps']} through the loop, the "
                     f"rest fast-forwarded; planner {m['planning_s']:.1f} s charged)")
    slow = sorted((e for e in res["segment_steps"] if e["slow_gpus"]),
                  key=lambda e: -e["worst_rate"])
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
    lines += _events(res["events"], top)
    d = res.get("detection")
    if d:
        lines.append(f"detection (malleus, {d['events']} changes): median {d['median_steps']} "
                     f"steps, longest {d['max_steps']}; the detector's own latency "
                     f"{d['latency_steps']} steps, {d['over']} change(s) took longer")
    be = [b for b in res.get("break_even", ())]
    if be:
        lines += ["", "break-even straggler duration (switching pays for stragglers longer "
                      "than this):",
                  f"{'GPUs':>6}{'rate':>7}{'times':>7}{'break-even s':>14}{'detect s':>10}"
                  f"{'plan s':>8}{'in s':>8}{'out s':>8}"]
        for b in be:
            d = "never" if b["break_even_s"] is None else f"{b['break_even_s']:.0f}"
            lines.append(f"{b['gpus']:>6d}{b['rate']:>7.2f}{b['count']:>7d}{d:>14}"
                         f"{b['detect_s']:>10.1f}{b['planning_s']:>8.2f}"
                         f"{b['migration_in_s']:>8.1f}{b['migration_out_s']:>8.1f}")
    return "\n".join(lines)


def _events(events: list[dict], top: int) -> list[str]:
    """The re-planning policies' decisions: the first ``top`` of each policy, then a count."""
    if not events:
        return []
    out = ["", "events (the change answered; detection, planning and pause seconds; what the "
               "switch won, in seconds of healthy training):",
           f"{'policy':<9}{'at s':>9}{'trigger':>10}{'adopted':>9}{'GPUs':>6}{'worst':>7}"
           f"{'detect s':>10}{'steps':>7}{'plan s':>8}{'pause s':>9}{'won s':>9}"]
    for pol in dict.fromkeys(e["policy"] for e in events):
        rows = [e for e in events if e["policy"] == pol]
        for e in rows[:top]:
            det = "" if e["detection_s"] is None else f"{e['detection_s']:.1f}"
            ds = "" if e.get("detection_steps") is None else str(e["detection_steps"])
            won = f"{e['won_s']:.0f}" if "won_s" in e else ""
            out.append(f"{pol:<9}{e['t_s']:>9.0f}{e['trigger']:>10}{str(e['adopted']):>9}"
                       f"{e['slow_gpus']:>6d}{e['worst_rate']:>7.2f}{det:>10}{ds:>7}"
                       f"{e['planning_s']:>8.2f}{e['migration_s']:>9.1f}{won:>9}")
        if len(rows) > top:
            out.append(f"{pol:<9}... {len(rows) - top} more (--json has all)")
    return out


def plot(res: dict, path: str | Path) -> None:
    """Samples/s of every policy over the trace (hours), the healthy and capacity levels, and
    a band where some GPU is slow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for e in res["segment_steps"]:
        if e["slow_gpus"]:
            ax.axvspan(e["start_s"] / 3600, e["end_s"] / 3600, color="0.9", lw=0)
    for name, tl in res["timelines"].items():
        xs, ys = [], []
        for a, b, sps in tl:
            xs += [a / 3600, b / 3600]
            ys += [sps, sps]
        ax.plot(xs, ys, label=name, lw=1.2)
    sw = [e["t_s"] / 3600 for e in res["events"] if e["policy"] == "malleus" and e["adopted"]]
    if sw:
        ax.plot(sw, [res["healthy_samples_per_s"] * 1.02] * len(sw), "v", ms=4,
                color="tab:red", label="malleus switches")
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
