#!/usr/bin/env python3
"""Turns the results of `strata bench all --out DIR` into PNG charts.

Reads DIR/bench.json and writes, into OUTDIR (default DIR):
  tier_bandwidth.png  best bandwidth per tier pair (host, device, NVMe)
  nvme_sweep.png      NVMe bandwidth vs block size, one line per (read/write, queue depth)
  copy_sizes.png      host<->device copy bandwidth vs transfer size
  adam_roofline.png   CPU optimizer step vs its memory-bandwidth roofline
  pipeline.png        a training step vs each resource alone
A chart whose benchmark did not run (its array empty or absent) is skipped with a note on
stderr. Each written path is printed on stdout. GB/s means 1e9 bytes per second.

Usage: scripts/plot_bench.py DIR [--out OUTDIR]
Needs matplotlib: on Debian, `apt install python3-matplotlib` (then run with /usr/bin/python3).
"""
import argparse
import json
import os
import sys

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None

PROG = "plot_bench.py"
GB = 1e9
WIDTH_IN, DPI = 10, 100  # 1000 px wide


def fail(message):
    print(f"{PROG}: error: {message}", file=sys.stderr)
    sys.exit(1)


def arrow(name):
    """'host_to_device' -> 'host → device'."""
    return name.replace("_to_", " → ")


def size_label(n):
    """131072 -> '128KiB', 1048576 -> '1MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def new_figure(title, machine, nrows=1, height=5.5):
    fig, axes = plt.subplots(nrows, 1, figsize=(WIDTH_IN, height), dpi=DPI,
                             layout="constrained", squeeze=False)
    fig.suptitle(f"{title}\n{machine}" if machine else title)
    return fig, list(axes[:, 0])


def log2_size_axis(ax, sizes, label):
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    ax.set_xticks(ticks, [size_label(s) for s in ticks])
    ax.minorticks_off()
    ax.set_xlabel(label)


def plot_tiers(entries, machine):
    fig, (ax,) = new_figure("Best bandwidth per tier pair", machine)
    labels = [f"{e['from']} → {e['to']}" + (f"\n({e['setting']})" if e.get("setting") else "")
              for e in entries]
    values = [e["bytes_per_second"] / GB for e in entries]
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(entries))])
    ax.bar_label(bars, labels=[f"{v:.2f} GB/s" for v in values], padding=3)
    ax.set_ylabel("bandwidth (GB/s)")
    ax.margins(y=0.15)
    return fig


def plot_bandwidth_lines(title, machine, entries, size_key, size_label, lines):
    """GB/s against a log2 size axis, one line per (label, linestyle, which entries)."""
    fig, (ax,) = new_figure(title, machine)
    for label, linestyle, keep in lines:
        points = sorted((e[size_key], e["bytes_per_second"] / GB) for e in entries if keep(e))
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o",
                linestyle=linestyle, label=label)
    log2_size_axis(ax, [e[size_key] for e in entries], size_label)
    ax.set_ylabel("bandwidth (GB/s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    return fig, ax


def plot_nvme(entries, machine):
    backends = sorted({e["backend"] for e in entries if "backend" in e})
    title = "NVMe sweep" + (f" ({', '.join(backends)})" if backends else "")
    lines = [(f"{rw}, qd {qd}", "-" if rw == "read" else "--",
              lambda e, rw=rw, qd=qd: e["rw"] == rw and e["queue_depth"] == qd)
             for rw, qd in sorted({(e["rw"], e["queue_depth"]) for e in entries})]
    fig, ax = plot_bandwidth_lines(title, machine, entries, "block_size", "block size", lines)
    ax.legend(ncol=2, fontsize="small")
    return fig


def plot_copies(entries, machine):
    lines = [(arrow(d), "-", lambda e, d=d: e["direction"] == d)
             for d in sorted({e["direction"] for e in entries})]
    fig, ax = plot_bandwidth_lines("Host ↔ device copy bandwidth vs transfer size", machine,
                                   entries, "bytes", "transfer size", lines)
    ax.legend()
    return fig


def adam_label(e):
    copy = e.get("param_copy")
    copy = f"{copy} copy" if copy and copy != "none" else "no copy"
    threads = f"{e['threads']} thread" + ("" if e["threads"] == 1 else "s")
    return (f"{e['grad_dtype']} grads + {copy}, {threads}\n"
            f"{e['optimizer']}, {e['state_dtype']} state, {e['simd']}")


def plot_adam(entries, machine):
    fig, (ax,) = new_figure("CPU optimizer step vs memory-bandwidth roofline", machine,
                            height=max(4.0, 1.5 + 1.1 * len(entries)))
    rows = range(len(entries))
    achieved = [e["bytes_per_second"] / GB for e in entries]
    roofline = [e["roofline_bytes_per_second"] / GB for e in entries]
    bars = ax.barh([y - 0.2 for y in rows], achieved, height=0.4, label="achieved")
    ax.bar_label(bars, padding=3, labels=[f"{a:.1f} GB/s ({e['ratio']:.0%} of roofline)"
                                          for a, e in zip(achieved, entries)])
    bars = ax.barh([y + 0.2 for y in rows], roofline, height=0.4, label="roofline", color="C7")
    ax.bar_label(bars, padding=3, labels=[f"{r:.1f} GB/s" for r in roofline])
    ax.set_yticks(list(rows), [adam_label(e) for e in entries])
    ax.invert_yaxis()
    ax.set_xlabel("memory traffic (GB/s)")
    ax.margins(x=0.3)
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False)
    return fig


def plot_pipeline(entries, machine):
    heights = [len(e["resources"]) + 2 for e in entries]
    fig, axes = new_figure("Training step vs each resource alone", machine, nrows=len(entries),
                           height=1.2 + 0.45 * sum(heights) + 0.8 * len(entries))
    for ax, e in zip(axes, entries):
        names = list(e["resources"])
        labels = [arrow(n) for n in names] + ["step (measured)", "all serial (sum)"]
        seconds = [e["resources"][n]["seconds"] for n in names]
        seconds += [e["step_median_seconds"], e["serial_seconds"]]
        colors = ["C1" if n == e["slowest"] else "C0" for n in names] + ["C3", "C7"]
        bars = ax.barh(labels, seconds, color=colors)
        ax.bar_label(bars, labels=[f"{s:.4f} s" for s in seconds], padding=3)
        ax.invert_yaxis()
        ax.set_title(f"offload optimizer: {e['offload_optimizer']} | step = "
                     f"{e['ratio_to_slowest']:.2f}× slowest ({arrow(e['slowest'])}), "
                     f"{e['ratio_to_serial']:.2f}× serial", fontsize="medium")
        ax.margins(x=0.15)
        ax.set_xlabel("time (s)")
    return fig


CHARTS = [
    ("tiers", "tier_bandwidth.png", plot_tiers),
    ("nvme", "nvme_sweep.png", plot_nvme),
    ("copies", "copy_sizes.png", plot_copies),
    ("adam", "adam_roofline.png", plot_adam),
    ("pipeline", "pipeline.png", plot_pipeline),
]


def load_bench(path):
    try:
        with open(path, encoding="utf-8") as f:
            bench = json.load(f)
    except FileNotFoundError:
        fail(f"{path} not found (run `strata bench all --out DIR` first)")
    except (OSError, ValueError) as e:
        fail(f"cannot read {path}: {e}")
    if not isinstance(bench, dict):
        fail(f"{path}: expected a JSON object at the top level")
    if bench.get("version") != 1:
        fail(f"{path}: unsupported version {bench.get('version')!r} (this script reads version 1)")
    return bench


def machine_line(machine):
    parts = [machine.get("cpu"),
             f"{machine['hardware_threads']} hardware threads" if "hardware_threads" in machine
             else None,
             machine.get("simd"),
             f"device: {machine['device']}" if "device" in machine else None]
    return " · ".join(str(p) for p in parts if p)


def main():
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("dir", metavar="DIR", help="directory holding bench.json")
    parser.add_argument("--out", metavar="OUTDIR", help="where to write the PNGs (default: DIR)")
    args = parser.parse_args()
    if plt is None:
        fail("matplotlib is not installed; on Debian install the package python3-matplotlib")

    source = os.path.join(args.dir, "bench.json")
    bench = load_bench(source)
    machine = machine_line(bench.get("machine") or {})
    out = args.out or args.dir
    os.makedirs(out, exist_ok=True)
    for key, name, plot in CHARTS:
        entries = bench.get(key) or []
        if not entries:
            print(f"{PROG}: note: no '{key}' results in {source}; skipping {name}",
                  file=sys.stderr)
            continue
        try:
            fig = plot(entries, machine)
        except (KeyError, TypeError, ValueError) as e:
            fail(f"{source}: malformed '{key}' entry ({type(e).__name__}: {e})")
        path = os.path.join(out, name)
        fig.savefig(path)
        plt.close(fig)
        print(path)


if __name__ == "__main__":
    main()
