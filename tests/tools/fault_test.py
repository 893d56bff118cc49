#!/usr/bin/env python3
"""Real faults through `strata train`: full disks, kill -9, a byte flipped in the swap file.

- A small tmpfs as the NVMe path: too small at the start is a clear error before step 1.
- A small tmpfs as the checkpoint folder: a checkpoint that cannot fit is refused before a
  byte is written, and one that runs out of space while writing fails naming the space it
  needed; either way the previous checkpoint is intact and resumes exactly.
- The NVMe path's file system filled up while training runs: swap space is reserved at Create
  (posix_fallocate), so training goes on with the losses of an undisturbed run.
- kill -9 at random moments of `train --checkpoint DIR --checkpoint-every 2`, and at the moment
  a save begins: DIR is always either absent or a checkpoint that resumes with the losses of an
  uninterrupted run, and a dead writer's staging folder is cleaned up by the next.
- Bytes flipped in the swap file while training runs: the step fails on the checksum, naming
  the chunk, and training stops (exit 1).
- `strata bench all` on a small tmpfs: the NVMe benchmarks fail saying why, the others run.

The tmpfs cases need root (mount); without it they are skipped with the reason, the rest run.
Usage: fault_test.py STRATA [SEED].
"""
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time

STRATA = sys.argv[1]
SEED = int(sys.argv[2]) if len(sys.argv) > 2 else int(time.time())
TRAIN = ["train", "--model", "tiny", "--batch", "8", "--seq", "128", "--eval-every", "0"]
PAGE = 4096
# The runs a fault lands in the middle of: long enough (about 5 s in release, a minute under
# ASan) that the disk fills before they end, short enough for the sanitized stage's time.
LONG_RUN = 100


def train(*args, check=True):
    result = subprocess.run([STRATA, *TRAIN, *args], capture_output=True, text=True, timeout=300)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def losses(stdout):
    return {s["step"]: s["loss"] for s in json.loads(stdout)["steps"]}


def checkpoint_step(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)["engine"]["step_count"]


class Tmpfs:
    """A tmpfs of `size` bytes mounted on a new folder; None where this machine cannot mount."""

    def __init__(self, size):
        self.path = tempfile.mkdtemp(prefix="strata-fault-")
        self.size = size

    def __enter__(self):
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs",
                                self.path], capture_output=True, text=True)
        if mount.returncode != 0:
            os.rmdir(self.path)
            return None
        return self.path

    def __exit__(self, *exc):
        if os.path.ismount(self.path):
            subprocess.run(["umount", self.path], check=True)
            os.rmdir(self.path)


def can_mount():
    if os.geteuid() != 0:
        return "not root, so no tmpfs can be mounted"
    with Tmpfs(PAGE) as path:
        return None if path else "mount -t tmpfs failed (no CAP_SYS_ADMIN?)"


def full_at_create():
    with Tmpfs(1 << 20) as nvme:
        r = train("--steps", "5", "--nvme-path", nvme, check=False)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert f"nvme path {nvme}: cannot reserve" in r.stderr and "free" in r.stderr, r.stderr
    assert "step " not in r.stdout + r.stderr, "training started on a disk too small"
    return r.stderr.strip().splitlines()[-1]


def checkpoint_sizes():
    """The pages one checkpoint of the tiny model takes on tmpfs: all of it, its data files."""
    with tempfile.TemporaryDirectory() as scratch:
        train("--steps", "3", "--checkpoint", f"{scratch}/one")
        pages = {p: -(-os.path.getsize(p) // PAGE) * PAGE for p in glob.glob(f"{scratch}/one/*")}
    return sum(pages.values()), sum(v for p, v in pages.items() if p.endswith(".bin"))


def checkpoint_full(reference, extra_bytes):
    """Checkpoints every 3 steps into a tmpfs that holds the first checkpoint and
    `extra_bytes` more; returns train's error."""
    one, _ = checkpoint_sizes()
    with Tmpfs(one + extra_bytes) as disk:
        ck = f"{disk}/ck"
        r = train("--steps", "8", "--checkpoint", ck, "--checkpoint-every", "3", check=False)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "saving the checkpoint" in r.stderr and ck in r.stderr, r.stderr
        # The previous checkpoint is there, whole, nothing else is, and it resumes exactly.
        assert sorted(os.listdir(disk)) == ["ck"], os.listdir(disk)
        assert checkpoint_step(ck) == 3
        resumed = losses(train("--steps", "8", "--resume", ck, "--json").stdout)
    assert resumed == {k: v for k, v in reference.items() if 4 <= k <= 8}, resumed
    return r.stderr.strip().splitlines()[-1]


def disk_fills_while_training(reference):
    with Tmpfs(64 << 20) as nvme:
        with tempfile.TemporaryFile("w+") as out:
            run = subprocess.Popen(
                [STRATA, *TRAIN, "--steps", str(LONG_RUN), "--nvme-path", nvme, "--json"],
                stdout=out, stderr=subprocess.PIPE, text=True)
            deadline = time.time() + 60
            while not glob.glob(f"{nvme}/strata-swap-*") and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # Into training.
            filler = 0
            # Unbuffered: a buffered file would try the tail again on close and raise ENOSPC.
            with open(f"{nvme}/filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(b"\0" * (1 << 20))
                        f.flush()
                        filler += 1 << 20
                except OSError:
                    pass
            free = os.statvfs(nvme).f_bavail * os.statvfs(nvme).f_frsize
            _, err = run.communicate(timeout=300)
            assert run.returncode == 0, err
            out.seek(0)
            got = losses(out.read())
    assert free < (1 << 20), f"the disk was not full: {free} bytes free"
    assert got == {k: v for k, v in reference.items() if k <= LONG_RUN}, "losses differ"
    return f"filled with {filler >> 20} MiB mid-run; {LONG_RUN} steps, losses identical"


def kill_at_random_moments(reference, runs=12):
    rng = random.Random(SEED)
    start = time.monotonic()
    train("--steps", "40")
    duration = time.monotonic() - start
    outcomes = []
    for i in range(runs):
        with tempfile.TemporaryDirectory() as scratch:
            ck = f"{scratch}/ck"
            run = subprocess.Popen([STRATA, *TRAIN, "--steps", "40", "--checkpoint", ck,
                                    "--checkpoint-every", "2"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if i % 3 == 2:
                # Every third run: the moment a save after the first begins (its staging
                # folder appears next to the checkpoint).
                deadline = time.monotonic() + duration * 2 + 10
                while time.monotonic() < deadline and not (
                        os.path.exists(ck) and glob.glob(f"{scratch}/ck.tmp-*")):
                    pass
                delay = -1.0
            else:
                delay = rng.uniform(0.3, 0.95) * duration
                time.sleep(delay)
            run.kill()
            run.wait()
            staged = [n for n in os.listdir(scratch) if n.startswith("ck.tmp-")]
            moment = "mid-save" if delay < 0 else f"{delay:.2f}s"
            if not os.path.exists(ck):
                outcomes.append(f"{moment}: before the first checkpoint")
                continue
            step = checkpoint_step(ck)
            # Resumed as a job is restarted: from DIR, checkpointing into it again.
            resumed = losses(train("--steps", "40", "--resume", ck, "--checkpoint", ck,
                                   "--checkpoint-every", "2", "--json").stdout)
            expected = {k: v for k, v in reference.items() if step < k <= 40}
            assert resumed == expected, f"run {i} (seed {SEED}): resume from {step} differs"
            assert not [n for n in os.listdir(scratch) if n.startswith("ck.tmp-")], \
                "the next writer did not clean up a dead one's staging folder"
            outcomes.append(f"{moment}: at step {step}" +
                            (" (a staging folder left, cleaned up)" if staged else ""))
    resumed_runs = sum("at step" in o for o in outcomes)
    assert resumed_runs >= runs // 2, f"too few kills after a checkpoint: {outcomes}"
    return f"seed {SEED}: " + "; ".join(outcomes)


def flipped_swap_bytes():
    rng = random.Random(SEED)
    with tempfile.TemporaryDirectory() as nvme:
        run = subprocess.Popen([STRATA, *TRAIN, "--steps", "100000", "--nvme-path", nvme],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while not glob.glob(f"{nvme}/strata-swap-*") and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        (swap,) = glob.glob(f"{nvme}/strata-swap-*")
        fd = os.open(swap, os.O_RDWR)
        flips = 0
        try:
            # Within the states the tiny model keeps there; until the engine notices.
            while run.poll() is None and flips < 10000:
                offset = rng.randrange(0, 1 << 20)
                byte = os.pread(fd, 1, offset)
                os.pwrite(fd, bytes([byte[0] ^ 0x10]), offset)
                flips += 1
                time.sleep(0.01)
        finally:
            os.close(fd)
            if run.poll() is None:
                run.kill()
        _, err = run.communicate(timeout=60)
    assert run.returncode == 1, f"training went on through {flips} flipped bytes: {err}"
    assert "checksum mismatch" in err and "updating chunk " in err, err
    return f"after {flips} flips: " + err.strip().splitlines()[-1]


def bench_all_on_a_full_disk():
    """`strata bench all` with an --nvme-path too small to measure: the NVMe benchmarks fail and
    say why, the others still run, and --out holds what was measured (exit 1)."""
    with Tmpfs(8 << 20) as nvme, tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "bench")
        r = subprocess.run([STRATA, "bench", "all", "--quick", "--nvme-path", nvme, "--out", out],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "nvme failed:" in r.stderr and "cannot reserve" in r.stderr, r.stderr
        assert "[3/4] copies" in r.stderr and "[4/4] pipeline" in r.stderr, r.stderr
        assert "nvme, pipeline could not be measured" in r.stderr, r.stderr
        assert "not measured" in r.stdout, r.stdout
        with open(os.path.join(out, "bench.json"), encoding="utf-8") as f:
            bench = json.load(f)
        assert set(bench["errors"]) == {"nvme", "pipeline"}, bench["errors"]
        assert "states on nvme" in bench["errors"]["pipeline"], bench["errors"]
        assert bench["adam"] and len(bench["copies"]) == 12, bench
        assert [p["offload_optimizer"] for p in bench["pipeline"]] == ["host"], bench["pipeline"]
        assert {(t["from"], t["to"]) for t in bench["tiers"]} == {("host", "device"),
                                                                   ("device", "host")}
        assert not os.listdir(nvme), "the benchmark left files on the disk"
    return r.stderr.strip().splitlines()[-1]


def main():
    reference = losses(train("--steps", str(LONG_RUN), "--json").stdout)
    results = []
    mount_problem = can_mount()
    if mount_problem:
        print(f"skipped (tmpfs cases): {mount_problem}")
    else:
        results.append(("nvme path too small at Create", full_at_create()))
        results.append(("checkpoint that cannot fit", checkpoint_full(reference, PAGE)))
        # Room for the data files, not for the manifest: it fails while writing.
        _, data = checkpoint_sizes()
        results.append(("disk full mid-checkpoint", checkpoint_full(reference, data)))
        results.append(("nvme disk filled while training", disk_fills_while_training(reference)))
        results.append(("bench all on a full disk", bench_all_on_a_full_disk()))
    results.append(("kill -9 at random moments", kill_at_random_moments(reference)))
    results.append(("bytes flipped in the swap file", flipped_swap_bytes()))
    for what, outcome in results:
        print(f"ok: {what}: {outcome}")


if __name__ == "__main__":
    main()
