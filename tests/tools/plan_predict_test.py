#!/usr/bin/env python3
"""`strata plan`'s predicted step time against `strata train`'s measured one, at two placements.

For optimizer states on host and on NVMe (parameters on the device), trains the small model with
a batch small enough that the offload traffic matters, takes the median step time and the
median model compute per step, then asks `strata plan --measure` (the same machine's rates,
measured through the engine) for the step time of the matching placements given that compute.
Prints both and the error; fails when it is beyond 25% in three tries in a row (a shared disk's
speed drifts between the run and the measurement).
Usage: plan_predict_test.py STRATA
"""
import json
import statistics
import subprocess
import sys
import tempfile

PLACEMENTS = {"host": "ZeRO-2, optimizer -> host", "nvme": "ZeRO-2, optimizer -> nvme"}
TOLERANCE = 0.25
TRIES = 3
CHUNK = "288KiB"  # strata train's default chunk for the small model.


def run_json(args):
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"
    return json.loads(done.stdout)


def measure_and_predict(strata, nvme, states):
    """One training run at the placement and one plan for it; returns the error."""
    run = run_json([strata, "train", "--batch", "1", "--seq", "8", "--steps", "40",
                    "--eval-every", "0", "--chunk-size", CHUNK, "--offload-optimizer", states,
                    "--offload-params", "device", "--nvme-path", nvme, "--json"])
    steady = run["steps"][10:]
    step = statistics.median(s["seconds"] for s in steady)
    compute = statistics.median(s["compute_seconds"] for s in steady)
    plan = run_json([strata, "plan", "--params", str(run["model"]["parameters"]), "--gpus", "1",
                     "--precision", "bf16", "--measure", "--chunk-size", CHUNK, "--nvme-path",
                     nvme, "--compute-seconds", str(compute), "--json"])
    row = next(p for p in plan["placements"] if p["name"] == PLACEMENTS[states])
    predicted = row["prediction"]["step_seconds"]
    error = predicted / step - 1
    print(f"states on {states}: measured {step * 1e3:.2f} ms per step "
          f"(compute {compute * 1e3:.2f} ms), predicted {predicted * 1e3:.2f} ms "
          f"(bound by {row['prediction']['bound_by']}), error {error:+.1%}", flush=True)
    return error


def main():
    strata = sys.argv[1]
    failures = []
    with tempfile.TemporaryDirectory() as nvme:
        for states in PLACEMENTS:
            # A shared disk's speed can change between the run and the plan's measurement: a
            # model that is wrong is wrong every time. With DeepSpeed's 4 state staging buffers
            # the engine read only 3 chunks ahead of backward and the NVMe error was -24% to
            # -28% every time (CI failed on it); with a buffer per chunk (the automatic count)
            # it is -6% to +12% on the development VM. HostDevice computes on the CPU the update
            # pipeline needs (two cores), which the model does not count. On a virtual disk
            # whose cache holds the small model's 18 MB of states, measuring NVMe on 256 MiB of
            # distinct extents made the prediction +24% to +57% pessimistic; --measure now cycles
            # through the model's own chunks (-8% to +22%).
            if all(abs(measure_and_predict(strata, nvme, states)) > TOLERANCE
                   for _ in range(TRIES)):
                failures.append(states)
    assert not failures, (f"prediction off by more than {TOLERANCE:.0%} {TRIES} times in a row "
                          f"for {failures}")


if __name__ == "__main__":
    main()
