#!/usr/bin/env python3
"""strata train under mpirun: two ranks with --batch 4 each train one model as one rank with
--batch 8 does (the same samples; bf16 sums in another order, so the losses agree to a stated
tolerance), stage 3 exactly as stage 2, three ranks (stage 3, states on NVMe) as one rank with
the whole batch, every stage x precision x placement trains on its defaults, Ctrl-C stops the
ranks together and cleanly, a rank killed or stopped mid-training ends the job naming it, strata
plan
--measure times the link across the ranks, only rank 0 prints, a checkpoint two ranks save resumes on two ranks and on one, and
an error on the ranks names each rank.

Usage: train_ranks_test.py STRATA MPIRUN
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

STRATA, MPIRUN = sys.argv[1], sys.argv[2]
MPI = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2"]
COMMON = ["train", "--model", "tiny", "--steps", "20", "--offload-optimizer", "host",
          "--json"]
TOLERANCE = 1e-3  # nats per byte, over 20 steps of bf16 training


def run(command, timeout=300):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def rank_pid(marker, rank, deadline):
    """The pid of the strata process of `rank` whose command line holds `marker`."""
    while time.time() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    command = f.read().split(b"\0")
                if STRATA.encode() not in command or marker.encode() not in command:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    environment = f.read().split(b"\0")
            except OSError:
                continue
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environment:
                return int(pid)
        time.sleep(0.05)
    sys.exit(f"rank {rank} (marker {marker}) never started")


def lose_rank_one(how, sig):
    """Trains on two ranks, sends rank 1 `sig` mid-training, and returns what mpirun returned
    and printed, and how long it took from the signal."""
    seed = "97531" if how == "killed" else "97532"
    steps = COMMON.index("--steps")
    command = (MPI + [STRATA] + COMMON[:steps] + ["--steps", "1000000"] + COMMON[steps + 2:] +
               ["--batch", "4", "--seed", seed, "--collective-timeout", "5"])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    pid = None
    try:
        pid = rank_pid(seed, 1, time.time() + 60)
        time.sleep(1.5)  # Mid-training.
        os.kill(pid, sig)
        lost = time.time()
        out, err = process.communicate(timeout=90)
        return process.returncode, out + err, time.time() - lost
    finally:
        if process.poll() is None:
            process.kill()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def every_default_combination():
    """Each ZeRO stage, precision and parameter placement trains on two ranks with nothing else
    given (the device budget, the host budget and the chunks all the defaults'), with the
    optimizer states in host memory and on NVMe. Stages 1 and 2 keep the parameters on the
    device (they refuse offloaded ones) and stage 3 keeps its shards off it (on the device it
    is refused, tested below)."""
    combinations = 0
    for stage in ("1", "2", "3"):
        for precision in ("fp32", "bf16", "fp16"):
            for params, states in (("device", "host"), ("device", "nvme")) if stage != "3" else (
                    ("host", "host"), ("host", "nvme"), ("nvme", "host"), ("nvme", "nvme")):
                command = MPI + [STRATA, "train", "--model", "tiny", "--steps", "2", "--json",
                                 "--zero-stage", stage, "--precision", precision,
                                 "--offload-params", params, "--offload-optimizer", states]
                code, out, err = run(command)
                assert code == 0, f"{' '.join(command[5:])} failed ({code}):\n{err}"
                assert len(json.loads(out)["steps"]) == 2, out
                combinations += 1
    print(f"every stage x precision x parameter placement on 2 ranks with the defaults: "
          f"{combinations} combinations trained")


def interrupted_ranks():
    """Ctrl-C to mpirun (which passes SIGTERM on to the ranks): every rank stops after the same
    step, removes its scratch swap, rank 0 says so, and nothing is left in TMPDIR."""
    with tempfile.TemporaryDirectory() as tmp:
        command = MPI + [STRATA, "train", "--model", "tiny", "--steps", "1000000",
                         "--eval-every", "0"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=dict(os.environ, TMPDIR=tmp))
        for line in process.stdout:
            if line.startswith("step     3"):
                break
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
        assert process.returncode != 0, (process.returncode, err)
        assert "strata train: interrupted by" in err, err
        assert err.count("interrupted by") == 1, f"only rank 0 prints: {err}"
        assert not os.listdir(tmp), f"left in TMPDIR: {os.listdir(tmp)}"
    print("Ctrl-C to mpirun: the ranks stopped together, rank 0 said so, TMPDIR empty")


def main():
    every_default_combination()
    interrupted_ranks()
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4"])
    if code != 0:
        sys.exit(f"two ranks failed ({code}):\n{err}")
    # One JSON document: rank 0's. A second rank printing would make this fail to parse.
    sharded = json.loads(out)
    code, out, err = run([STRATA] + COMMON + ["--batch", "8", "--offload-params", "device"])
    if code != 0:
        sys.exit(f"one rank failed ({code}):\n{err}")
    single = json.loads(out)

    assert sharded["ranks"]["world_size"] == 2, sharded["ranks"]
    assert sharded["ranks"]["zero_stage"] == 2, sharded["ranks"]
    assert single["ranks"]["world_size"] == 1, single["ranks"]
    a = [s["loss"] for s in single["steps"]]
    b = [s["loss"] for s in sharded["steps"]]
    assert len(a) == len(b) == 20, (len(a), len(b))
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst < TOLERANCE, f"losses differ by {worst}: {a} vs {b}"
    assert b[-1] < b[0] - 1.0, f"the loss did not fall: {b[0]} -> {b[-1]}"
    for s, t in zip(single["steps"], sharded["steps"]):
        assert abs(s["grad_norm"] - t["grad_norm"]) < 1e-2 * s["grad_norm"], (s, t)
    print(f"2 ranks x batch 4 vs 1 rank x batch 8: losses within {worst:.2e} over 20 steps "
          f"({a[0]:.4f} -> {a[-1]:.4f}); validation {sharded['validation_loss']:.4f} vs "
          f"{single['validation_loss']:.4f}")

    # Sharded checkpoints: two ranks save after 10 steps (every rank its shards); two ranks and
    # one rank (with the whole batch) resume from it and continue as the uninterrupted run.
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = os.path.join(scratch, "checkpoint")
        first = COMMON[:COMMON.index("--steps")] + ["--steps", "10"] + COMMON[
            COMMON.index("--steps") + 2:]
        code, out, err = run(MPI + [STRATA] + first + ["--batch", "4", "--checkpoint",
                                                         checkpoint])
        assert code == 0, err
        with open(os.path.join(checkpoint, "manifest.json")) as f:
            manifest = json.load(f)
        assert manifest["engine"]["world_size"] == 2, manifest["engine"]
        resumed = {}
        for name, launch, batch in (("2 ranks", MPI, ["--batch", "4"]),
                                    ("1 rank", [], ["--batch", "8", "--offload-params",
                                                    "device"])):
            code, out, err = run(launch + [STRATA] + COMMON + batch + ["--resume", checkpoint])
            assert code == 0, f"{name} resuming: {err}"
            steps = json.loads(out)["steps"]
            assert [s["step"] for s in steps] == list(range(11, 21)), steps
            resumed[name] = max(abs(s["loss"] - b[s["step"] - 1]) for s in steps)
        # The same ranks continue the same sums: exactly; one rank sums in another order.
        assert resumed["2 ranks"] == 0.0, resumed
        assert resumed["1 rank"] < TOLERANCE, resumed
    print(f"saved by 2 ranks at step 10, resumed to 20: by 2 ranks exactly, by 1 rank within "
          f"{resumed['1 rank']:.2e} of the uninterrupted run")

    # Stage 1 shards the optimizer states and takes stage 2's path here (a reduce-scatter of the
    # gradients, the updated shards all-gathered): the same losses exactly.
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4", "--zero-stage", "1"])
    assert code == 0, f"stage 1 failed ({code}):\n{err}"
    stage1 = json.loads(out)
    assert stage1["ranks"]["zero_stage"] == 1, stage1["ranks"]
    assert [s["loss"] for s in stage1["steps"]] == b, "stage 1 differs from stage 2"
    print("stage 1 on 2 ranks: the same losses as stage 2, exactly")

    # Stage 3: each rank keeps half the parameters and gathers a chunk's on every Acquire. The
    # gathered parameters are the ones stage 2 gathers after the update: the same losses exactly.
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4", "--zero-stage", "3"])
    assert code == 0, f"stage 3 failed ({code}):\n{err}"
    stage3 = json.loads(out)
    assert stage3["ranks"]["zero_stage"] == 3, stage3["ranks"]
    c = [s["loss"] for s in stage3["steps"]]
    assert c == b, f"stage 3 differs from stage 2: {c} vs {b}"
    print("stage 3 on 2 ranks: the same losses as stage 2, exactly")

    # ZeRO++'s quantized weights: the same run gathering int8 shards moves about half the bytes
    # of bf16 and trains within a loose tolerance of the exact gathers (forward and backward
    # see weights within half a quantization step; the master weights stay exact).
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4", "--zero-stage", "3",
                                                    "--zero-quantized-weights"])
    assert code == 0, f"stage 3 with quantized weights failed ({code}):\n{err}"
    quantized = json.loads(out)
    assert quantized["ranks"]["quantized_weights"] is True, quantized["ranks"]
    ratio = quantized["summary"]["all_gather_bytes"] / stage3["summary"]["all_gather_bytes"]
    assert 0.5 < ratio < 0.52, ratio
    assert quantized["summary"]["reduce_scatter_bytes"] == stage3["summary"]["reduce_scatter_bytes"]
    q = [s["loss"] for s in quantized["steps"]]
    worst_q = max(abs(x - y) for x, y in zip(q, c))
    assert 0 < worst_q < 0.05, f"quantized losses differ by {worst_q}: {q} vs {c}"
    print(f"stage 3 with quantized weights: all-gather bytes x{ratio:.3f}, losses within "
          f"{worst_q:.2e} of exact gathers over 20 steps")

    # And its quantized gradients, with the weights quantized too: the reduction moves a quarter
    # of fp32's bytes (an all-to-all of int8 partitions, summed in fp32 where they arrive).
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4", "--zero-stage", "3",
                                                    "--zero-quantized-weights",
                                                    "--zero-quantized-gradients"])
    assert code == 0, f"stage 3 with quantized gradients failed ({code}):\n{err}"
    both = json.loads(out)
    assert both["ranks"]["quantized_gradients"] is True, both["ranks"]
    ratio_g = both["summary"]["reduce_scatter_bytes"] / stage3["summary"]["reduce_scatter_bytes"]
    assert 0.25 < ratio_g < 0.26, ratio_g
    g = [s["loss"] for s in both["steps"]]
    worst_g = max(abs(x - y) for x, y in zip(g, c))
    assert 0 < worst_g < 0.05, f"quantized losses differ by {worst_g}: {g} vs {c}"
    print(f"stage 3 with quantized weights and gradients: gradient bytes x{ratio_g:.3f}, losses "
          f"within {worst_g:.2e} of exact collectives over 20 steps")

    # Int4 gradients (DeepSpeed's qgZ width): an eighth of fp32's bytes and the scales, steps 18
    # times as coarse as int8's, so a looser tolerance (0.1; 150 steps of the small model stay
    # within 0.11 too).
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4", "--zero-stage", "3",
                                                    "--zero-quantized-gradients",
                                                    "--zero-quantized-gradient-bits", "4"])
    assert code == 0, f"stage 3 with int4 gradients failed ({code}):\n{err}"
    int4 = json.loads(out)
    assert int4["ranks"]["quantized_gradient_bits"] == 4, int4["ranks"]
    ratio_4 = int4["summary"]["reduce_scatter_bytes"] / stage3["summary"]["reduce_scatter_bytes"]
    assert 0.125 < ratio_4 < 0.135, ratio_4
    assert int4["summary"]["all_gather_bytes"] == stage3["summary"]["all_gather_bytes"]
    g4 = [s["loss"] for s in int4["steps"]]
    worst_4 = max(abs(x - y) for x, y in zip(g4, c))
    assert 0 < worst_4 < 0.1, f"int4 losses differ by {worst_4}: {g4} vs {c}"
    print(f"stage 3 with int4 gradients: gradient bytes x{ratio_4:.3f}, losses within "
          f"{worst_4:.2e} of exact collectives over 20 steps")

    # An uneven split: three ranks (chunks padded to three shards), stage 3 with the states on
    # NVMe, against one rank with the whole batch.
    three = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "3"]
    nvme = COMMON[:COMMON.index("host")] + ["nvme"] + COMMON[COMMON.index("host") + 1:]
    code, out, err = run(three + [STRATA] + nvme + ["--batch", "4", "--zero-stage", "3"])
    assert code == 0, f"3 ranks failed ({code}):\n{err}"
    by_three = json.loads(out)
    assert by_three["ranks"]["world_size"] == 3, by_three["ranks"]
    code, out, err = run([STRATA] + nvme + ["--batch", "12", "--offload-params", "device"])
    assert code == 0, f"one rank with the whole batch failed ({code}):\n{err}"
    by_one = [s["loss"] for s in json.loads(out)["steps"]]
    d = [s["loss"] for s in by_three["steps"]]
    worst3 = max(abs(x - y) for x, y in zip(by_one, d))
    assert len(d) == 20 and worst3 < TOLERANCE, f"losses differ by {worst3}: {by_one} vs {d}"
    print(f"3 ranks x batch 4 (stage 3, states on NVMe) vs 1 rank x batch 12: losses within "
          f"{worst3:.2e} over 20 steps")

    # A rank that dies mid-training takes the job down at once, named (by mpirun); one that
    # hangs (stopped) fails the other's next collective after --collective-timeout, named.
    code, text, seconds = lose_rank_one("killed", signal.SIGKILL)
    assert code != 0 and "rank 1" in text, (code, text)
    print(f"rank 1 killed mid-training: the job exits ({code}) after {seconds:.1f} s, naming it")
    code, text, seconds = lose_rank_one("stopped", signal.SIGSTOP)
    assert code != 0, (code, text)
    assert "rank 0 of 2:" in text and "rank 1, the other rank, died, hangs" in text, text
    assert seconds < 5 + 30, seconds
    print(f"rank 1 stopped mid-training: rank 0 exits ({code}) after {seconds:.1f} s "
          f"(collective timeout 5 s), naming it")

    # ZeRO-Infinity across ranks: each rank keeps its shard of the parameters on NVMe and reads
    # it for every gather; the gathered parameters are the same, and so are the losses.
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4", "--zero-stage", "3",
                                                    "--offload-params", "nvme"])
    assert code == 0, f"stage 3 with parameter shards on NVMe failed ({code}):\n{err}"
    on_nvme = json.loads(out)
    assert on_nvme["placement"]["params"] == "nvme", on_nvme["placement"]
    assert on_nvme["summary"]["nvme_read_bytes"] > 0, on_nvme["summary"]
    e = [s["loss"] for s in on_nvme["steps"]]
    assert e == c, f"parameter shards on NVMe differ from host memory: {e} vs {c}"
    print("stage 3 with parameter shards on NVMe on 2 ranks: the same losses exactly")

    # What is not built for several ranks: every rank says so, naming itself; nothing trains.
    code, out, err = run(MPI + [STRATA] + COMMON + ["--batch", "4", "--zero-stage", "3",
                                                    "--offload-params", "device"])
    assert code != 0, "stage 3 with parameter shards on the device should be refused"
    for rank in (0, 1):
        assert f"rank {rank} of 2:" in err and "offload_param cpu or nvme" in err, err
    assert '"steps"' not in out, out
    print("stage 3 with parameter shards on the device refused on both ranks, each naming itself")

    # strata plan --measure under mpirun times the link with the engine's collectives across the
    # ranks (the node's other rates given here, so that only the link is measured); --gpus
    # defaults to the ranks, and one rank prints.
    code, out, err = run(MPI + [STRATA, "plan", "--params", "1e9", "--measure", "--json",
                                "--h2d-gbps", "10", "--d2h-gbps", "10", "--nvme-read-gbps", "3",
                                "--nvme-write-gbps", "3", "--optimizer-gparams", "1",
                                "--chunk-size", "4MiB"])
    assert code == 0, err
    plan = json.loads(out)
    link = plan["machine"]["link_bytes_per_second"]
    assert plan["gpus"] == 2 and link > 0, (plan["gpus"], link)
    assert err.count("measuring the link") == 1, err
    print(f"strata plan --measure on 2 ranks: link {link / 1e9:.2f} GB/s (MPI on host memory)")

    # A DeepSpeed config's batch sizes count every rank: 16 = 4 per rank x 2 micro-steps x 2.
    # Stage 2 reduces every micro-step's gradients into the rank's shard (no rank keeps a whole
    # chunk's sum); stage 1 sums the micro-steps first and reduces once: half the gradient
    # bytes, and the same losses but for the order of the fp32 sums.
    accumulating = {}
    with tempfile.TemporaryDirectory() as scratch:
        for stage in (2, 1):
            config = os.path.join(scratch, f"ds{stage}.json")
            with open(config, "w") as f:
                json.dump({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                           "gradient_accumulation_steps": 2,
                           "zero_optimization": {"stage": stage,
                                                 "offload_optimizer": {"device": "cpu"}}}, f)
            code, out, err = run(MPI + [STRATA, "train", "--model", "tiny", "--steps", "10",
                                        "--config", config, "--json"])
            assert code == 0, err
            document = json.loads(out)
            assert document["optimizer"]["micro_batch"] == 4, document["optimizer"]
            assert document["optimizer"]["gradient_accumulation_steps"] == 2, document["optimizer"]
            assert document["ranks"]["zero_stage"] == stage, document["ranks"]
            accumulating[stage] = document
    stage2, stage1 = accumulating[2], accumulating[1]
    ratio = stage2["summary"]["reduce_scatter_bytes"] / stage1["summary"]["reduce_scatter_bytes"]
    assert ratio == 2.0, ratio
    worst = max(abs(x["loss"] - y["loss"]) for x, y in zip(stage2["steps"], stage1["steps"]))
    assert worst < TOLERANCE, f"stage 2 and stage 1 accumulating differ by {worst}"
    print(f"a DeepSpeed config for 2 ranks: 4 sequences x 2 micro-steps per rank; stage 2 "
          f"reduces each micro-step (gradient bytes x{ratio:.1f} stage 1's), losses within "
          f"{worst:.2e} of stage 1's over 10 steps")


if __name__ == "__main__":
    main()
