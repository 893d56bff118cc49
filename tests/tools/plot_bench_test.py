#!/usr/bin/env python3
"""Checks scripts/plot_bench.py against a sample bench.json.

Usage: plot_bench_test.py PLOT_BENCH_PY. Exits 0 on pass, 1 on failure, and 77 (skipped) when
this interpreter has no matplotlib (Debian's python3-matplotlib, under /usr/bin/python3).
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

if importlib.util.find_spec("matplotlib") is None:
    print(f"matplotlib is not installed for {sys.executable} (python3-matplotlib); skipping")
    sys.exit(77)

SCRIPT = None  # set from argv in __main__
CHARTS = ["tier_bandwidth.png", "nvme_sweep.png", "copy_sizes.png", "adam_roofline.png",
          "pipeline.png"]
KiB, MiB = 1 << 10, 1 << 20


def sample_bench():
    copies = [{"direction": d, "bytes": 64 * KiB << i, "seconds": (64 * KiB << i) / bw,
               "bytes_per_second": bw}
              for d, peak in (("host_to_device", 9.1e9), ("device_to_host", 8.7e9))
              for i in range(11) for bw in [peak * (i + 1) / 11]]
    nvme = [{"rw": rw, "block_size": bs, "queue_depth": qd, "bytes": 1 << 30,
             "seconds": (1 << 30) / bw, "bytes_per_second": bw, "backend": "io_uring"}
            for rw in ("read", "write") for qd in (1, 8, 32)
            for bs in (128 * KiB, 256 * KiB, 512 * KiB, MiB, 2 * MiB, 4 * MiB, 8 * MiB)
            for bw in [min(3.6e9, 2e8 * qd * bs / (128 * KiB)) * (1.0 if rw == "read" else 1.1)]]
    adam = [{"optimizer": "adamw", "numel": 67108864, "grad_dtype": g, "state_dtype": "fp32",
             "param_copy": c, "simd": "avx2", "roofline_simd": "avx2", "threads": t,
             "bytes_per_param": 28, "params_per_second": 1.29e9 * t / 2,
             "bytes_per_second": 36e9 * t / 2, "roofline_params_per_second": 1.35e9,
             "roofline_bytes_per_second": 37.9e9, "ratio": 0.951 * t / 2}
            for g, c in (("bf16", "bf16"), ("fp32", "none")) for t in (1, 2)]

    def resource(seconds, nbytes=0):
        return {"seconds": seconds, "bytes": nbytes}

    pipeline = [
        {"offload_optimizer": "host",
         "resources": {"compute": resource(0.2457), "device_to_host": resource(0.0376, 128 * MiB),
                       "host_to_device": resource(0.0419, 128 * MiB),
                       "cpu_adam": resource(0.066)},
         "slowest": "compute", "slowest_seconds": 0.2457, "serial_seconds": 0.3912,
         "step_median_seconds": 0.2585, "ratio_to_slowest": 1.052, "ratio_to_serial": 0.661},
        {"offload_optimizer": "nvme",
         "resources": {"compute": resource(0.2457), "device_to_host": resource(0.0376, 128 * MiB),
                       "host_to_device": resource(0.0419, 128 * MiB),
                       "cpu_adam": resource(0.066), "nvme_read": resource(0.31, 1 << 30),
                       "nvme_write": resource(0.29, 1 << 30)},
         "slowest": "nvme_read", "slowest_seconds": 0.31, "serial_seconds": 0.9912,
         "step_median_seconds": 0.35, "ratio_to_slowest": 1.129, "ratio_to_serial": 0.353},
    ]
    return {
        "version": 1,
        "machine": {"cpu": "AMD EPYC 7B13", "hardware_threads": 2, "simd": "avx2",
                    "device": "host", "nvme_path": "/tmp"},
        "tiers": [
            {"from": "host", "to": "device", "bytes_per_second": 9.1e9, "setting": "64MiB copies"},
            {"from": "device", "to": "host", "bytes_per_second": 8.7e9, "setting": "64MiB copies"},
            {"from": "nvme", "to": "host", "bytes_per_second": 3.6e9, "setting": "1MiB x qd32"},
            {"from": "host", "to": "nvme", "bytes_per_second": 4.0e9, "setting": "1MiB x qd32"},
        ],
        "copies": copies, "nvme": nvme, "adam": adam, "pipeline": pipeline,
    }


class PlotBenchTest(unittest.TestCase):
    def make_dir(self, bench_text=None):
        """A temporary DIR, holding bench.json when bench_text is given."""
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        if bench_text is not None:
            with open(os.path.join(tmp.name, "bench.json"), "w", encoding="utf-8") as f:
                f.write(bench_text)
        return tmp.name

    def run_script(self, *args, env=None):
        return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                              timeout=120, env=env)

    def assert_png(self, path):
        self.assertTrue(os.path.isfile(path), f"{path} was not written")
        with open(path, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG")
        self.assertGreater(os.path.getsize(path), 5000, f"{path} is suspiciously small")

    def assert_error(self, proc):
        self.assertEqual(proc.returncode, 1, proc.stderr)
        self.assertIn("plot_bench.py: error:", proc.stderr)

    def test_all_charts(self):
        d = self.make_dir(json.dumps(sample_bench()))
        proc = self.run_script(d)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        expected = [os.path.join(d, name) for name in CHARTS]
        for path in expected:
            self.assert_png(path)
        self.assertEqual(sorted(proc.stdout.splitlines()), sorted(expected))

    def test_out_option(self):
        d = self.make_dir(json.dumps(sample_bench()))
        out = os.path.join(self.make_dir(), "charts", "nested")
        proc = self.run_script(d, "--out", out)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(sorted(os.listdir(out)), sorted(CHARTS))
        self.assertEqual(os.listdir(d), ["bench.json"])

    def test_only_tiers(self):
        bench = sample_bench()
        only_tiers = {"version": 1, "machine": bench["machine"], "tiers": bench["tiers"],
                      "nvme": []}  # an empty array and absent keys are both "did not run"
        d = self.make_dir(json.dumps(only_tiers))
        proc = self.run_script(d)
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertEqual(sorted(os.listdir(d)), ["bench.json", "tier_bandwidth.png"])
        self.assert_png(os.path.join(d, "tier_bandwidth.png"))
        self.assertEqual(proc.stdout.splitlines(), [os.path.join(d, "tier_bandwidth.png")])
        for skipped in CHARTS[1:]:
            self.assertIn(skipped, proc.stderr, "a skipped chart should be noted on stderr")

    def test_missing_bench_json(self):
        self.assert_error(self.run_script(self.make_dir()))

    def test_malformed_json(self):
        self.assert_error(self.run_script(self.make_dir('{"version": 1, "tiers": [')))

    def test_wrong_version(self):
        bench = dict(sample_bench(), version=2)
        d = self.make_dir(json.dumps(bench))
        self.assert_error(self.run_script(d))
        self.assertEqual(os.listdir(d), ["bench.json"])

    def test_missing_matplotlib(self):
        fake = self.make_dir()
        os.mkdir(os.path.join(fake, "matplotlib"))
        with open(os.path.join(fake, "matplotlib", "__init__.py"), "w", encoding="utf-8") as f:
            f.write("raise ImportError('no matplotlib here')\n")
        d = self.make_dir(json.dumps(sample_bench()))
        proc = self.run_script(d, env=dict(os.environ, PYTHONPATH=fake))
        self.assert_error(proc)
        self.assertIn("python3-matplotlib", proc.stderr)

    def test_help(self):
        proc = self.run_script("--help")
        self.assertEqual(proc.returncode, 0, proc.stderr)
        self.assertIn("--out", proc.stdout)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: plot_bench_test.py PLOT_BENCH_PY [unittest args...]")
    SCRIPT = os.path.abspath(sys.argv.pop(1))
    unittest.main()
