#!/usr/bin/env python3
"""`strata bench all --quick --out DIR`, then `scripts/plot_bench.py DIR`: the whole path from
measuring a machine to its charts.

Checks the progress lines, bench.json's fields and counts (the contract plot_bench.py and other
scripts read), that each CSV has its header and a row per result, and that every chart is drawn.
Usage: bench_all_test.py STRATA PLOT_BENCH_PY. Exits 77 (skipped) without matplotlib.
"""
import csv
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

if importlib.util.find_spec("matplotlib") is None:
    print(f"matplotlib is not installed for {sys.executable} (python3-matplotlib); skipping")
    sys.exit(77)


def main():
    strata, plot = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "bench")
        run = subprocess.run([strata, "bench", "all", "--quick", "--out", out,
                              "--nvme-path", scratch], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr
        for step in range(1, 5):
            assert f"[{step}/4]" in run.stderr, f"no progress line {step}: {run.stderr}"
        assert "Tiers of" in run.stdout and "plot_bench.py" in run.stdout, run.stdout

        with open(os.path.join(out, "bench.json"), encoding="utf-8") as f:
            bench = json.load(f)
        assert bench["version"] == 1
        pairs = {(t["from"], t["to"]) for t in bench["tiers"]}
        assert pairs == {("host", "device"), ("device", "host"), ("nvme", "host"),
                         ("host", "nvme")}, pairs
        assert all(t["bytes_per_second"] > 0 for t in bench["tiers"]), bench["tiers"]
        assert len(bench["adam"]) in (2, 4), bench["adam"]  # 1 and all threads, 2 dtypes
        assert all(0.3 < a["ratio"] < 2.0 for a in bench["adam"]), bench["adam"]
        assert len(bench["nvme"]) == 12  # 3 block sizes x 2 queue depths x read/write
        assert len(bench["copies"]) == 12  # 6 sizes x 2 directions
        states = [p["offload_optimizer"] for p in bench["pipeline"]]
        assert states == ["host", "nvme"], states
        for p in bench["pipeline"]:
            # The slowest resource, NVMe reads and writes counted together (same drives).
            times = {n: r["seconds"] for n, r in p["resources"].items()
                     if not n.startswith("nvme_")}
            if "nvme_read" in p["resources"]:
                times["nvme"] = (p["resources"]["nvme_read"]["seconds"]
                                 + p["resources"]["nvme_write"]["seconds"])
            assert abs(p["slowest_seconds"] - max(times.values())) < 1e-9, (times, p)
            assert p["slowest"] == max(times, key=times.get), (times, p)
            assert abs(p["ratio_to_slowest"]
                       - p["step_median_seconds"] / p["slowest_seconds"]) < 1e-9, p
            assert 0.5 < p["ratio_to_slowest"] < 5, p
        # The disk is never left with the benchmark's file.
        assert not [f for f in os.listdir(scratch) if f.startswith("strata-bench")]

        for name, key in (("tiers", "tiers"), ("adam", "adam"), ("nvme", "nvme"),
                          ("copies", "copies"), ("pipeline", "pipeline")):
            with open(os.path.join(out, f"{name}.csv"), encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
            assert len(rows) == len(bench[key]), (name, len(rows))
            assert "bytes_per_second" in rows[0] or "ratio_to_slowest" in rows[0], rows[0]

        drawn = subprocess.run([sys.executable, plot, out], capture_output=True, text=True,
                               timeout=300)
        assert drawn.returncode == 0, drawn.stderr
        charts = sorted(os.path.basename(p) for p in drawn.stdout.split())
        assert charts == ["adam_roofline.png", "copy_sizes.png", "nvme_sweep.png",
                          "pipeline.png", "tier_bandwidth.png"], charts
        for chart in charts:
            with open(os.path.join(out, chart), "rb") as f:
                assert f.read(8) == b"\x89PNG\r\n\x1a\n", chart
    print(f"ok: {len(bench['tiers'])} tier pairs, {len(bench['nvme'])} nvme passes, "
          f"{len(charts)} charts")


if __name__ == "__main__":
    main()
