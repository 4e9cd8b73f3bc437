"""The figures of ``ncclwatch report`` (matplotlib, Agg backend: no display needed).

Time runs along x in seconds since the recording's first record. Detected anomalies are
shaded red (orange for warnings), injected faults from labels.json hatched grey, and the
job's throughput is the grey line on a second axis: a busbw dip that lines up with a
throughput dip is communication costing the job time.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: reports are written on headless machines

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from ncclwatch.dashboards.run import (  # noqa: E402
    Interval,
    Key,
    Run,
    comm_label,
    comms_by_size,
    key_series,
    rank_matrix,
    top_keys,
)

from ncclwatch.rules import NETWORK_TRANSPORTS  # noqa: E402

SEVERITY_COLOR = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#9467bd"}
NETWORK_COLOR = "#e6550d"
THROUGHPUT_COLOR = "#7b3294"
NVLINK_COLOR = "#3182bd"
DPI = 110


def _s(run: Run, ns: float) -> float:
    return (ns - run.t0_ns) / 1e9


def _shade(ax, run: Run, anomalies: list[Interval], faults: list[Interval]) -> None:
    """Anomalies shade the whole height; injected faults are a hatched strip along the top."""
    for f in faults:
        ax.axvspan(
            _s(run, f.start_ns),
            _s(run, f.end_ns),
            ymin=0.93,
            ymax=1.0,
            facecolor="white",
            edgecolor="0.3",
            hatch="////",
            linewidth=0.6,
            zorder=3,
        )
    for a in anomalies:
        color = SEVERITY_COLOR.get(a.event.severity if a.event else "", "#d62728")
        end_s = max(_s(run, a.end_ns), _s(run, a.start_ns) + 1)  # a one-window event stays visible
        ax.axvspan(_s(run, a.start_ns), end_s, color=color, alpha=0.16, linewidth=0, zorder=0)


def _legend_patches(anomalies: list[Interval], faults: list[Interval]) -> list[Patch]:
    out = []
    severities = sorted({a.event.severity for a in anomalies if a.event})
    for sev in severities:
        out.append(Patch(color=SEVERITY_COLOR.get(sev, "#d62728"), alpha=0.3, label=f"anomaly ({sev})"))
    if faults:
        out.append(Patch(facecolor="white", edgecolor="0.3", hatch="////", label="injected fault (labels)"))
    return out


def _throughput(ax, run: Run, job: str, *, label: bool = True):
    tp = sorted(run.throughput.get(job, []), key=lambda t: t.ts_ns)
    if not tp:
        return None
    twin = ax.twinx()
    twin.plot(
        [_s(run, t.ts_ns) for t in tp],
        [t.tflops_per_gpu for t in tp],
        color=THROUGHPUT_COLOR,
        linewidth=0.8,
        alpha=0.75,
        label="throughput",
    )
    if label:
        twin.set_ylabel("TFLOP/s per GPU", color=THROUGHPUT_COLOR)
    twin.tick_params(axis="y", colors=THROUGHPUT_COLOR, labelsize=7)
    # Throughput in the lower part of the axes, busbw above: the two rarely cross, and a
    # dip in one can be lined up with a dip in the other.
    lo, hi = min(t.tflops_per_gpu for t in tp), max(t.tflops_per_gpu for t in tp)
    pad = max(hi - lo, hi * 0.05)
    twin.set_ylim(lo - 0.3 * pad, hi + 2.2 * pad)
    return twin


def _key_label(run: Run, key: Key) -> str:
    _, comm, op, bucket, transport = key
    w = next(iter(next(iter(run.windows[key].values())).values()))
    return f"{op} {bucket} over {transport} · {w.comm_name or 'comm'} …{comm[-4:]} ({w.nranks} ranks)"


def _reference(run: Run, key: Key, series) -> float:
    """What 100 % means for a key: its final learned baseline, else its early median."""
    base = run.baselines.get(key)
    if base:
        return base[-1][1]
    head = sorted(m for _, m, _, _ in series[: max(3, len(series) // 4)])
    return head[len(head) // 2]


def overview(run: Run, job: str, path: Path, max_keys: int = 12) -> bool:
    """Throughput on top, every key's busbw relative to its baseline below, anomalies shaded."""

    keys = top_keys(run, job, max_keys)
    if not keys and not run.throughput.get(job):
        return False
    anomalies, faults = run.intervals(job), run.fault_intervals(job)
    fig, (ax_tp, ax_bw) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    tp = sorted(run.throughput.get(job, []), key=lambda t: t.ts_ns)
    if tp:
        ax_tp.plot(
            [_s(run, t.ts_ns) for t in tp],
            [t.tflops_per_gpu for t in tp],
            color="0.2",
            linewidth=1.2,
        )
    else:
        ax_tp.text(0.5, 0.5, "no throughput records", transform=ax_tp.transAxes, ha="center", color="0.5")
    ax_tp.set_ylabel("TFLOP/s per GPU")
    ax_tp.set_title(f"job {job}: throughput and communication health", loc="left", fontsize=11)
    for key in keys:
        series = key_series(run, key)
        ref = _reference(run, key, series)
        if ref <= 0:
            continue
        color = NETWORK_COLOR if key[4] in NETWORK_TRANSPORTS else NVLINK_COLOR
        ax_bw.plot(
            [_s(run, s) for s, *_ in series],
            [m / ref for _, m, _, _ in series],
            color=color,
            linewidth=0.9,
            alpha=0.75,
        )
    ax_bw.axhline(1.0, color="0.3", linewidth=0.8)
    from ncclwatch.config import DetectorConfig

    floor = 1 - DetectorConfig().threshold
    ax_bw.axhline(floor, color="#d62728", linewidth=0.8, linestyle=":")
    ax_bw.set_ylabel("busbw / baseline")
    ax_bw.set_xlabel("seconds since the first record")
    for ax in (ax_tp, ax_bw):
        _shade(ax, run, anomalies, faults)
        ax.grid(True, alpha=0.25)
    handles = [
        plt.Line2D([], [], color=NETWORK_COLOR, label="network / mixed keys"),
        plt.Line2D([], [], color=NVLINK_COLOR, label="NVLink-only keys"),
        plt.Line2D([], [], color="#d62728", linestyle=":", label=f"degraded below {floor:.0%}"),
        *_legend_patches(anomalies, faults),
    ]
    lo, hi = ax_bw.get_ylim()
    lo, hi = max(lo, 0.0), min(hi, 1.6)
    ax_bw.set_ylim(lo, hi + 0.1 * (hi - lo))  # headroom for the injected-fault strip
    lo, hi = ax_tp.get_ylim()
    ax_tp.set_ylim(lo, hi + 0.1 * (hi - lo))
    fig.legend(handles=handles, loc="lower center", fontsize=8, ncol=len(handles), frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def keys(run: Run, job: str, path: Path, max_keys: int = 12) -> bool:
    """One small plot per key: busbw median and rank spread, baseline, throughput overlaid."""

    chosen = top_keys(run, job, max_keys)
    if not chosen:
        return False
    anomalies, faults = run.intervals(job), run.fault_intervals(job)
    ncols = 2 if len(chosen) > 1 else 1
    nrows = math.ceil(len(chosen) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 2.9 * nrows), sharex=True, squeeze=False)
    for ax, key in zip(axes.flat, chosen, strict=False):
        series = key_series(run, key)
        t = [_s(run, s) for s, *_ in series]
        color = NETWORK_COLOR if key[4] in NETWORK_TRANSPORTS else NVLINK_COLOR
        ax.fill_between(
            t,
            [lo for *_, lo, _ in series],
            [hi for *_, hi in series],
            color=color,
            alpha=0.18,
            linewidth=0,
            label="rank min–max",
        )
        ax.plot(t, [m for _, m, _, _ in series], color=color, linewidth=1.1, label="median over ranks")
        base = run.baselines.get(key)
        if base:
            bx = [_s(run, s) for s, _ in base]
            by = [b for _, b in base]
            ax.plot(bx, by, color="0.15", linewidth=0.9, linestyle="--", label="baseline")
            if run.threshold:
                # the band a window must fall below to count as degraded
                ax.fill_between(
                    bx,
                    [b * (1 - run.threshold) for b in by],
                    by,
                    color="0.5",
                    alpha=0.15,
                    linewidth=0,
                    label=f"baseline band (−{run.threshold:.0%})",
                )
        mine = [a for a in anomalies if a.covers(key)]
        _shade(ax, run, mine, faults)
        ax.set_title(_key_label(run, key), fontsize=9, loc="left")
        ax.set_ylabel("busbw GB/s", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.set_ylim(0, max(hi for *_, hi in series) * 1.15)  # headroom for the fault strip
        ax.grid(True, alpha=0.25)
        _throughput(ax, run, job, label=False)
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    for col in range(ncols):  # x labels under the lowest plot of each column
        visible = [ax for ax in axes[:, col] if ax.get_visible()]
        visible[-1].tick_params(labelbottom=True)
        visible[-1].set_xlabel("seconds since the first record", fontsize=8)
    handles = [
        plt.Line2D([], [], color="0.4", linewidth=1.1, label="busbw, median over ranks"),
        Patch(color="0.4", alpha=0.2, label="rank min–max"),
        *([plt.Line2D([], [], color="0.15", linestyle="--", label="learned baseline")] if run.baselines else []),
        *(
            [Patch(color="0.5", alpha=0.15, label=f"baseline − {run.threshold:.0%}: degraded below")]
            if run.baselines and run.threshold
            else []
        ),
        plt.Line2D([], [], color=THROUGHPUT_COLOR, label="job TFLOP/s per GPU (right axis)"),
        *_legend_patches(anomalies, faults),
    ]
    top = 1 - 0.6 / fig.get_figheight()  # room for the title and legend, in figure fraction
    fig.suptitle(
        f"job {job}: bus bandwidth per key (blue: NVLink-only, orange: network / mixed)",
        fontsize=11,
        x=0.01,
        y=1 - 0.12 / fig.get_figheight(),
        ha="left",
        va="top",
    )
    fig.legend(
        handles=handles,
        loc="upper left",
        bbox_to_anchor=(0.01, 1 - 0.42 / fig.get_figheight()),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return True


def ranks(run: Run, job: str, path: Path, max_comms: int = 4) -> bool:
    """Per-rank relative exec time for the largest communicators: a straggler stays red."""

    comms = comms_by_size(run, job)[:max_comms]
    if not comms:
        return False
    stragglers = [a for a in run.intervals(job) if a.kind == "straggler"]
    mats = [rank_matrix(run, job, c) for c in comms]
    heights = [len(m[0]) + 1.2 for m in mats]
    fig, axes = plt.subplots(
        len(comms),
        1,
        figsize=(12, 1.4 + 0.3 * sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights, "hspace": 0.55},
        sharex=True,
    )
    image = None
    for ax, comm, (rank_ids, starts, matrix) in zip(axes[:, 0], comms, mats, strict=True):
        x0, x1 = _s(run, starts[0]), _s(run, starts[-1]) + run_window_s(run)
        image = ax.imshow(
            matrix,
            aspect="auto",
            cmap="RdBu",
            vmin=0.5,
            vmax=1.5,
            interpolation="nearest",
            extent=(x0, x1, len(rank_ids) - 0.5, -0.5),
        )
        ax.set_yticks(range(len(rank_ids)), [str(r) for r in rank_ids], fontsize=7)
        ax.set_ylabel("rank", fontsize=8)
        ax.set_title(comm_label(run, job, comm), fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
        for a in stragglers:  # a bar under the rows while a straggler anomaly is active
            if a.key.get("comm") in (None, comm):
                ax.axvspan(_s(run, a.start_ns), _s(run, a.end_ns), ymin=0, ymax=0.08, color="black")
    axes[-1, 0].set_xlabel("seconds since the first record")
    fig.suptitle(
        f"job {job}: each rank's kernel time / the other ranks' median "
        "(red below 1: the rank the others wait for; black bar: straggler anomaly)",
        fontsize=10,
        x=0.01,
        ha="left",
    )
    if image is not None:
        bar = fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.03, pad=0.01)
        bar.set_label("relative exec time", fontsize=8)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return True


def run_window_s(run: Run) -> float:
    """The window length of the run's summaries (1 s unless the forwarder was told otherwise)."""
    for by_start in run.windows.values():
        for ranks in by_start.values():
            w = next(iter(ranks.values()))
            return (w.end_ns - w.start_ns) / 1e9
    return 1.0
