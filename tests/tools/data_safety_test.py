#!/usr/bin/env python3
"""Strata never destroys what is not its own, through the `strata` command line.

Strata deletes or overwrites only what it can prove it created, refuses bad paths and input
files before it trains (exit 1, or 2 for a usage error, one "strata: error: " line, no "step "
line), and cleans up after itself however a run ends, SIGINT and SIGTERM included.

 1a --checkpoint naming a folder of the user's notes: refused, naming a file in it; unchanged.
 1b the same through a symbolic link to that folder.
 1c --checkpoint and --nvme-path the same folder (empty, and holding a file): refused ("nvme").
 1d --checkpoint naming the folder that holds the --data corpus: refused ("corpus").
 1e a user's file added into a Strata checkpoint: the next save there is refused, naming it.
 1f an existing empty folder is accepted, and a Strata checkpoint is saved over again.
 2a `bench nvme --file F`, F a user's 1 MiB file: write, both and read refused; F unchanged.
 2b F a user's 16 MiB file: write and both refused, read runs (exit 0); F unchanged.
 2c F a symbolic link to a user's file, or /dev/null: refused ("not a regular file").
 2d F absent: created (exit 0); written again, as Strata's own now (exit 0).
 2e `bench all --out DIR` where DIR holds a user's tiers.csv or bench.json: refused before
    measuring, the file unchanged.
 3  user files named like swap files in --nvme-path: unchanged, and nothing else left there.
 4a SIGINT while training with --checkpoint-every 2 and --nvme-path: after cleaning up, the
    process ends by SIGINT (the shell's 130, so a script stops too) in time, naming the
    checkpoint; the checkpoint whole, no staging folder, NVMe folder and TMPDIR empty.
 4b the same with SIGTERM (143).
 4c SIGINT with the default scratch swap under TMPDIR: ends by SIGINT, TMPDIR empty.
 4d two SIGINTs during a long step: the second ends the process at once, by SIGINT, leaving its
    scratch folder; the next run removes it.
 4e a scratch folder named for a live process is left alone by a run.
 5  runs that end normally and runs that fail leave TMPDIR and --nvme-path empty.
 6  --checkpoint as a bare relative name, saved every step.
 7a --checkpoint under a parent that does not exist: refused before the first step.
 7b --checkpoint on a read-only file system (a read-only tmpfs with room; root only): refused.
 7c --checkpoint /proc/x: refused.
 8  a manifest value edited (step count, a chunk's steps, the loss scaler's iteration): the
    resume is refused on the manifest's checksum; a manifest rewritten unchanged resumes.
 9  --resume with the manifest or a chunk file replaced by a FIFO, a link to /dev/zero or a
    directory: refused in time, saying what the file is.
10a `config check /dev/zero`, 10b a 20 MiB config, 10c `train --data DIR`, 10d a config with
    nvme.block_size 1TiB: each refused.
11a an fp32 checkpoint resumed with --precision bf16: the message names the precisions.
11b --metrics-address localhost works; 11c --metrics-port -5 is a usage error.

Every case works in a fresh temporary folder, with TMPDIR a fresh private folder for every
strata process, and checks with snapshot() that no file of the user's changed. The tmpfs case
needs root (mount); without it it is skipped with the reason. The `bench nvme` cases need a
file system with O_DIRECT: on tmpfs they are skipped with the reason.
Prints one line per case, then "N passed, M failed"; exits 1 if any case failed.
Usage: data_safety_test.py STRATA [CASE...]  (case numbers, e.g. 1a 8; all when none)
"""
import glob
import hashlib
import json
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback

STRATA = sys.argv[1]
TRAIN = ["train", "--model", "tiny", "--batch", "8", "--seq", "128", "--eval-every", "0"]
# CI is a loaded 2-core machine, and this test runs under AddressSanitizer too.
TIMEOUT = 300
BENCH = ["bench", "nvme", "--size", "8MiB", "--block-size", "1MiB", "--queue-depth", "4"]
ERROR_PREFIX = "strata: error: "


# ---------------------------------------------------------------------------------------------
# Helpers


class Failure(AssertionError):
    pass


def check(condition, message):
    if not condition:
        raise Failure(message)


class Run:
    """A finished strata process: its arguments, exit code and output."""

    def __init__(self, args, returncode, stdout, stderr):
        self.args, self.returncode, self.stdout, self.stderr = args, returncode, stdout, stderr

    def __str__(self):
        def tail(text, lines=12):
            kept = text.rstrip().splitlines()[-lines:]
            return "\n".join("      " + line for line in kept) or "      (empty)"

        return (f"    $ {' '.join(self.args)}\n    exit {self.returncode}\n"
                f"    stdout (end):\n{tail(self.stdout)}\n    stderr (end):\n{tail(self.stderr)}")


class Case:
    """One case's own folders: `dir` to work in, `tmp` as every strata process's TMPDIR."""

    def __init__(self):
        self.root = tempfile.mkdtemp(prefix="strata-safety-")
        self.dir = os.path.join(self.root, "work")
        self.tmp = os.path.join(self.root, "tmp")
        os.mkdir(self.dir)
        os.mkdir(self.tmp)
        self.notes = []

    def path(self, *parts):
        return os.path.join(self.dir, *parts)

    def env(self):
        return dict(os.environ, TMPDIR=self.tmp)

    def strata(self, *args, timeout=TIMEOUT, cwd=None):
        argv = [STRATA, *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  env=self.env(), cwd=cwd or self.dir)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            raise Failure(f"did not end within {timeout} s (killed)\n" +
                          str(Run(argv, "-", out or "", err or ""))) from None
        return Run(argv, done.returncode, done.stdout, done.stderr)

    def train(self, *args, **kwargs):
        return self.strata(*TRAIN, *args, **kwargs)

    def cleanup(self):
        # Unmount anything a case mounted under its folder (deepest first), then remove it all.
        with open("/proc/mounts") as f:
            mounts = [line.split()[1] for line in f]
        for point in sorted((m for m in mounts if m.startswith(self.root + "/")), reverse=True):
            subprocess.run(["umount", point], capture_output=True)
        for dirpath, dirnames, _ in os.walk(self.root):
            for name in dirnames:  # A case may leave a folder without write permission.
                full = os.path.join(dirpath, name)
                if not os.path.islink(full) and not os.path.ismount(full):
                    os.chmod(full, 0o755)
        shutil.rmtree(self.root, ignore_errors=True)


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def snapshot(root):
    """{relative path: (kind, sha256 or link target)} of everything under `root`, links not
    followed (a link is recorded with its target, never read through)."""
    entries = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            mode = os.lstat(full).st_mode
            if stat.S_ISLNK(mode):
                entries[rel] = ("link", os.readlink(full))
            elif stat.S_ISDIR(mode):
                entries[rel] = ("dir", None)
            elif stat.S_ISREG(mode):
                entries[rel] = ("file", sha256(full))
            elif stat.S_ISFIFO(mode):
                entries[rel] = ("fifo", None)
            else:
                entries[rel] = ("other", oct(mode))
    return entries


def assert_unchanged(before, after, what, own=()):
    """Fails naming every entry of `before` changed or gone and every entry added, except
    entries under the prefixes in `own` (Strata's own files, which may appear or change)."""

    def ours(rel):
        return any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in own)

    changed = [f"changed: {r}" for r in before if r in after and before[r] != after[r]]
    gone = [f"gone: {r}" for r in before if r not in after]
    added = [f"added: {r}" for r in after if r not in before]
    problems = [p for p in changed + gone + added if not ours(p.split(": ", 1)[1])]
    check(not problems, f"{what} changed: " + "; ".join(sorted(problems)))


def no_steps(stdout):
    """True when the run printed no training step."""
    return not any(line.startswith("step ") for line in stdout.splitlines())


def contains(text, needle):
    return needle.lower() in text.lower()


def expect_ok(c, r, tmp_empty=True):
    check(r.returncode == 0, f"expected exit 0\n{r}")
    if tmp_empty:
        expect_tmp_empty(c, r)


def expect_refused(c, r, code, *needles, tmp_empty=True):
    """Exit `code` before any step, one "strata: error: " line, holding every needle."""
    check(r.returncode == code, f"expected exit {code}\n{r}")
    check(no_steps(r.stdout), f"refused, but it trained first\n{r}")
    errors = [line for line in r.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
    check(len(errors) == 1, f"expected one line starting {ERROR_PREFIX!r}, got {len(errors)}\n{r}")
    missing = [n for n in needles if not contains(errors[0], n)]
    check(not missing, f"the error does not say {missing}\n{r}")
    if tmp_empty:
        expect_tmp_empty(c, r)


def expect_tmp_empty(c, r=None):
    left = sorted(os.listdir(c.tmp))
    check(not left, f"TMPDIR holds {left} afterwards" + (f"\n{r}" if r else ""))


def write_random(path, size, seed):
    rng = random.Random(seed)
    with open(path, "wb") as f:
        f.write(rng.randbytes(size))


def manifest_path(ck):
    return os.path.join(ck, "manifest.json")


def staging_left(ck):
    """Strata's staging and replaced folders beside checkpoint `ck` ("ck.tmp-*", "ck.old-*")."""
    return sorted(glob.glob(glob.escape(ck) + ".tmp-*") + glob.glob(glob.escape(ck) + ".old-*"))


def save_checkpoint(c, ck, *extra):
    r = c.train("--steps", "2", "--checkpoint", ck, *extra)
    expect_ok(c, r)
    check(os.path.isfile(manifest_path(ck)), f"no manifest.json in {ck} after a save\n{r}")
    return r


WORDS = ("the a of to and in that it was he for on are as with his they at be this from have "
         "or by one had not but what all were when we there can an your which their said if do "
         "will each about how up out them then she many some so these would other into has more "
         "her two like him see time could no make than first been its who now people my made "
         "over did down only way find use may water long little very after words called just "
         "where most know get through back much go good new write our me man too any day same "
         "right look think also around another came come work three word must because does part "
         "river garden window morning letter mountain station engine paper winter").split()

_corpus = None


def corpus_source(c):
    """The shipped corpus when `strata train --help` names its path, else a 64 KiB text file of
    English-like lines written once into a folder of this test's own."""
    global _corpus
    if _corpus and os.path.isfile(_corpus):
        return _corpus
    r = c.strata("train", "--help")
    found = re.search(r"--data\b.*?\(default:?\s*([^\s)]+)\)", r.stdout, re.S)
    if found and os.path.isfile(found.group(1)):
        _corpus = found.group(1)
        return _corpus
    rng = random.Random(7)
    lines, size = [], 0
    while size < 64 << 10:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        line = " ".join(words).capitalize() + rng.choice(".!?") + "\n"
        lines.append(line)
        size += len(line)
    folder = tempfile.mkdtemp(prefix="strata-safety-corpus-")
    _corpus = os.path.join(folder, "corpus.txt")
    with open(_corpus, "w") as f:
        f.write("".join(lines))
    return _corpus


def filesystem_type(path):
    """The type of the file system holding `path`, from /proc/mounts (longest mount point)."""
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and \
                    len(point) > len(best):
                best, kind = point, fields[2]
    return kind


class Skip(Exception):
    pass


def needs_direct_io(c):
    kind = filesystem_type(c.dir)
    if kind == "tmpfs":
        raise Skip(f"{c.dir} is on tmpfs, which has no O_DIRECT for bench nvme")


# ---------------------------------------------------------------------------------------------
# 1. Checkpoint ownership


def checkpoint_into_user_folder(c):
    os.mkdir(c.path("notes"))
    with open(c.path("notes", "a.txt"), "w") as f:
        f.write("draft\n")
    before = snapshot(c.dir)
    r = c.train("--steps", "2", "--checkpoint", c.path("notes"))
    expect_refused(c, r, 1, "not a Strata checkpoint", "a.txt")
    assert_unchanged(before, snapshot(c.dir), c.dir)
    return r.stderr.strip().splitlines()[-1]


def checkpoint_through_link(c):
    os.mkdir(c.path("notes"))
    with open(c.path("notes", "a.txt"), "w") as f:
        f.write("draft\n")
    os.symlink("notes", c.path("link"))
    before = snapshot(c.dir)
    r = c.train("--steps", "2", "--checkpoint", c.path("link"))
    expect_refused(c, r, 1, "not a Strata checkpoint", "a.txt")
    assert_unchanged(before, snapshot(c.dir), c.dir)


def checkpoint_is_nvme_path(c):
    os.mkdir(c.path("empty"))
    os.mkdir(c.path("full"))
    write_random(c.path("full", "keep.bin"), 4096, 1)
    for folder in ("empty", "full"):
        before = snapshot(c.dir)
        d = c.path(folder)
        r = c.train("--steps", "2", "--checkpoint", d, "--nvme-path", d)
        expect_refused(c, r, 1, "nvme")
        assert_unchanged(before, snapshot(c.dir), c.dir)


def checkpoint_holds_corpus(c):
    os.mkdir(c.path("data"))
    # Not named "corpus": the message must say what the file is, not only repeat its name.
    corpus = c.path("data", "book.txt")
    shutil.copyfile(corpus_source(c), corpus)
    before = snapshot(c.dir)
    r = c.train("--steps", "2", "--data", corpus, "--checkpoint", c.path("data"))
    expect_refused(c, r, 1, "corpus")
    assert_unchanged(before, snapshot(c.dir), c.dir)


def user_file_in_checkpoint(c):
    ck = c.path("ck")
    save_checkpoint(c, ck)
    with open(os.path.join(ck, "mine.txt"), "w") as f:
        f.write("my own notes\n")
    before = snapshot(c.dir)
    r = c.train("--steps", "2", "--checkpoint", ck)
    expect_refused(c, r, 1, "mine.txt")
    assert_unchanged(before, snapshot(c.dir), c.dir)


def empty_folder_then_resave(c):
    ck = c.path("ck")
    os.mkdir(ck)
    save_checkpoint(c, ck)
    save_checkpoint(c, ck, "--seed", "2")
    check(not staging_left(ck), f"left beside the checkpoint: {staging_left(ck)}")
    check(sorted(os.listdir(c.dir)) == ["ck"], f"{c.dir} holds {sorted(os.listdir(c.dir))}")


# ---------------------------------------------------------------------------------------------
# 2. strata bench nvme --file


def bench(c, f, rw):
    return c.strata(*BENCH, "--path", c.path("d"), "--file", f, "--rw", rw)


def bench_user_file_small(c):
    needs_direct_io(c)
    os.mkdir(c.path("d"))
    f = c.path("d", "user.bin")
    write_random(f, 1 << 20, 2)
    for rw in ("write", "both", "read"):
        before = snapshot(c.dir)
        r = bench(c, f, rw)
        expect_refused(c, r, 1, "was not created by strata")
        assert_unchanged(before, snapshot(c.dir), f"{c.dir} (--rw {rw})")


def bench_user_file_large(c):
    needs_direct_io(c)
    os.mkdir(c.path("d"))
    f = c.path("d", "user.bin")
    write_random(f, 16 << 20, 3)
    for rw in ("write", "both"):
        before = snapshot(c.dir)
        r = bench(c, f, rw)
        expect_refused(c, r, 1, "was not created by strata")
        assert_unchanged(before, snapshot(c.dir), f"{c.dir} (--rw {rw})")
    before = snapshot(c.dir)
    r = bench(c, f, "read")
    expect_ok(c, r)
    assert_unchanged(before, snapshot(c.dir), f"{c.dir} (--rw read)")


def bench_not_regular(c):
    needs_direct_io(c)
    os.mkdir(c.path("d"))
    target = c.path("d", "user.bin")
    write_random(target, 16 << 20, 4)
    os.symlink(target, c.path("d", "link.bin"))
    for f in (c.path("d", "link.bin"), "/dev/null"):
        for rw in ("write", "read"):
            before = snapshot(c.dir)
            r = bench(c, f, rw)
            expect_refused(c, r, 1, "not a regular file")
            assert_unchanged(before, snapshot(c.dir), f"{c.dir} (--file {f} --rw {rw})")
    check(os.path.exists("/dev/null") and stat.S_ISCHR(os.stat("/dev/null").st_mode),
          "/dev/null is no longer a character device")


def bench_own_file(c):
    needs_direct_io(c)
    os.mkdir(c.path("d"))
    f = c.path("d", "bench.bin")
    expect_ok(c, bench(c, f, "both"))
    check(os.path.isfile(f), f"{f} was not created")
    expect_ok(c, bench(c, f, "write"))
    check(os.path.isfile(f), f"{f} is gone after a second run")


def bench_all_out_foreign(c):
    # A folder holding files of the names `bench all --out` writes, not written by it: refused
    # before any measuring, each file as it was. (Writing a new folder, and over its own output,
    # is bench_all_test.py's.)
    out = c.path("results")
    os.mkdir(out)
    for name, text in (("tiers.csv", "quarter,revenue\nQ1,10\n"),
                       ("bench.json", '{"my": "own results"}\n')):
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
        before = snapshot(out)
        r = c.strata("bench", "all", "--quick", "--out", out, "--nvme-path", c.dir)
        expect_refused(c, r, 1, "not written by strata bench all", name)
        assert_unchanged(before, snapshot(out), out)
        os.remove(os.path.join(out, name))


# ---------------------------------------------------------------------------------------------
# 3. Swap leftovers


def swap_leftovers(c):
    d = c.path("nvme")
    os.mkdir(d)
    for seed, name in enumerate(("strata-swap-notes.txt", "strata-swap-0-1.bin",
                                 "strata-swap-999999-0.bin")):
        write_random(os.path.join(d, name), 64 << 10, 10 + seed)
    before = snapshot(d)
    expect_ok(c, c.train("--steps", "2", "--nvme-path", d))
    assert_unchanged(before, snapshot(d), d)


# ---------------------------------------------------------------------------------------------
# 4. Signals


class Interrupted:
    def __init__(self, run, seconds):
        self.run, self.seconds = run, seconds


def interrupt(c, args, signals, wait, gap=0.2, at_step=3):
    """Starts `strata train ARGS`, sends `signals` (`gap` s apart) once the line of step
    `at_step` is printed, and waits at most `wait` s for it to end."""
    argv = [STRATA, *TRAIN, *args]
    marker = f"step {at_step:5d}"
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=c.env(),
                             cwd=c.dir)
        lines, seen = [], threading.Event()
        reached = []

        def read():
            for line in p.stdout:
                lines.append(line)
                if line.startswith(marker):
                    reached.append(True)
                    seen.set()
            seen.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            seen.wait(TIMEOUT)
            if not reached or p.poll() is not None:
                p.kill()
                p.wait()
                reader.join(10)
                err.seek(0)
                raise Failure(f"never reached step {at_step} while running\n" +
                              str(Run(argv, p.returncode, "".join(lines), err.read())))
            start = time.monotonic()
            for i, sig in enumerate(signals):
                if i:
                    time.sleep(gap)
                p.send_signal(sig)
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                reader.join(10)
                err.seek(0)
                names = " then ".join(signal.Signals(s).name for s in signals)
                raise Failure(f"still running {wait} s after {names} (killed)\n" +
                              str(Run(argv, "-", "".join(lines), err.read()))) from None
            seconds = time.monotonic() - start
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        reader.join(10)
        err.seek(0)
        return Interrupted(Run(argv, p.returncode, "".join(lines), err.read()), seconds)


def signal_with_checkpoint(c, sig, code):
    ck, nvme = c.path("ck"), c.path("nvme")
    os.mkdir(nvme)
    got = interrupt(c, ["--steps", "100000", "--checkpoint", ck, "--checkpoint-every", "2",
                        "--nvme-path", nvme], [sig], wait=120)
    r = got.run
    check(r.returncode == -sig,
          f"expected the process to end by {signal.Signals(sig).name} (the shell's {code})\n{r}")
    check(contains(r.stderr, "interrupted"), f"stderr does not say it was interrupted\n{r}")
    check(contains(r.stderr, "checkpoint"), f"stderr does not name the last checkpoint\n{r}")
    expect_tmp_empty(c, r)
    check(not os.listdir(nvme), f"the NVMe folder holds {sorted(os.listdir(nvme))}\n{r}")
    check(os.path.isfile(manifest_path(ck)), f"no checkpoint (manifest.json) in {ck}\n{r}")
    check(not staging_left(ck), f"left beside the checkpoint: {staging_left(ck)}\n{r}")
    return f"ended by {signal.Signals(sig).name} {got.seconds:.1f} s after it"


def sigint_with_checkpoint(c):
    return signal_with_checkpoint(c, signal.SIGINT, 130)


def sigterm_with_checkpoint(c):
    return signal_with_checkpoint(c, signal.SIGTERM, 143)


def sigint_scratch(c):
    got = interrupt(c, ["--steps", "100000"], [signal.SIGINT], wait=120)
    r = got.run
    check(r.returncode == -signal.SIGINT, f"expected the process to end by SIGINT\n{r}")
    check(contains(r.stderr, "interrupted by SIGINT"), f"stderr does not say it was interrupted\n{r}")
    expect_tmp_empty(c, r)
    return f"ended by SIGINT {got.seconds:.1f} s after it"


def double_sigint(c):
    # Steps of a few seconds (the small model, 64 sequences), so that both signals arrive
    # while the step after step 1 runs: the second cannot wait for it.
    got = interrupt(c, ["--steps", "100000", "--model", "small", "--batch", "64"],
                    [signal.SIGINT, signal.SIGINT], wait=30, at_step=1)
    r = got.run
    check(r.returncode == -signal.SIGINT, f"expected the second SIGINT to end it at once\n{r}")
    check(not contains(r.stderr, "interrupted by"),
          f"the first SIGINT's step finished before the second arrived\n{r}")
    left = sorted(n for n in os.listdir(c.tmp) if n.startswith("strata-train-"))
    check(len(left) == 1, f"expected the killed run's scratch folder in TMPDIR, found {left}")
    after = c.train("--steps", "1")
    expect_ok(c, after)  # Also: TMPDIR empty, the dead run's scratch removed.
    return f"ended by the second SIGINT {got.seconds:.1f} s after the first; left {left}, " \
           f"removed by the next run"


def live_scratch_kept(c):
    live = os.path.join(c.tmp, f"strata-train-{os.getpid()}-Xq3zR7")
    os.mkdir(live)
    write_random(os.path.join(live, f"strata-swap-{os.getpid()}-0.bin"), 64 << 10, 20)
    before = snapshot(c.tmp)
    r = c.train("--steps", "1")
    expect_ok(c, r, tmp_empty=False)
    assert_unchanged(before, snapshot(c.tmp), f"TMPDIR {c.tmp}")


# ---------------------------------------------------------------------------------------------
# 5. Nothing left after a normal end or an error


def clean_end(c):
    nvme = c.path("nvme")
    os.mkdir(nvme)
    expect_ok(c, c.train("--steps", "2"))
    r = c.train("--steps", "2", "--nvme-path", nvme)
    expect_ok(c, r)
    check(not os.listdir(nvme), f"the NVMe folder holds {sorted(os.listdir(nvme))}\n{r}")
    missing = c.path("missing")
    expect_refused(c, c.train("--steps", "2", "--resume", missing), 1)
    r = c.train("--steps", "2", "--resume", missing, "--nvme-path", nvme)
    expect_refused(c, r, 1)
    check(not os.listdir(nvme), f"the NVMe folder holds {sorted(os.listdir(nvme))}\n{r}")


# ---------------------------------------------------------------------------------------------
# 6. A bare relative checkpoint name


def relative_checkpoint(c):
    r = c.train("--steps", "3", "--checkpoint", "ck", "--checkpoint-every", "1", cwd=c.dir)
    expect_ok(c, r)
    check(os.path.isfile(c.path("ck", "manifest.json")), f"no ck/manifest.json\n{r}")
    check(sorted(os.listdir(c.dir)) == ["ck"], f"{c.dir} holds {sorted(os.listdir(c.dir))}")


# ---------------------------------------------------------------------------------------------
# 7. The output path, checked before the first step


def missing_parent(c):
    r = c.train("--steps", "2", "--checkpoint", "missing/parent/ck", cwd=c.dir)
    expect_refused(c, r, 1, "does not exist")
    check(not os.listdir(c.dir), f"{c.dir} holds {sorted(os.listdir(c.dir))}")


def read_only_parent(c):
    if os.geteuid() != 0:
        raise Skip("not root, so no tmpfs can be mounted")
    ro = c.path("ro")
    os.mkdir(ro)
    # Room for the tiny model's checkpoint (about 2 MiB), so that being read-only is the only
    # thing wrong with it, whichever check comes first.
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16m", "tmpfs", ro],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        raise Skip(f"mount -t tmpfs failed: {mount.stderr.strip()}")
    r = c.train("--steps", "2", "--checkpoint", os.path.join(ro, "ck"))
    expect_refused(c, r, 1, "read-only")


def proc_checkpoint(c):
    expect_refused(c, c.train("--steps", "2", "--checkpoint", "/proc/x"), 1)


# ---------------------------------------------------------------------------------------------
# 8. The manifest's checksum


def manifest_checksum(c):
    ck = c.path("ck")
    save_checkpoint(c, ck)
    with open(manifest_path(ck)) as f:
        original = json.load(f)

    def rewrite(edit):
        manifest = json.loads(json.dumps(original))
        edit(manifest)
        with open(manifest_path(ck), "w") as f:
            json.dump(manifest, f, indent=2)

    # Control: the same values written again (other whitespace) still resume.
    rewrite(lambda m: None)
    expect_ok(c, c.train("--steps", "4", "--resume", ck))

    def bump(*keys):
        def edit(m):
            for k in keys[:-1]:
                m = m[k]
            m[keys[-1]] += 1
        return edit

    edits = [("engine.step_count", ("engine", "step_count")),
             ("chunks[0].steps", ("chunks", 0, "steps"))]
    scaler = original.get("engine", {}).get("loss_scaler", {})
    if "iteration" in scaler:
        edits.append(("engine.loss_scaler.iteration", ("engine", "loss_scaler", "iteration")))
    for name, keys in edits:
        rewrite(bump(*keys))
        before = snapshot(c.dir)
        r = c.train("--steps", "4", "--resume", ck)
        try:
            expect_refused(c, r, 1, "checksum")
        except Failure as e:
            raise Failure(f"{name} + 1: {e}") from None
        assert_unchanged(before, snapshot(c.dir), c.dir)
    return "edited: " + ", ".join(name for name, _ in edits)


# ---------------------------------------------------------------------------------------------
# 9. Hostile files in a checkpoint being resumed


def hostile_resume_files(c):
    ck = c.path("ck")
    save_checkpoint(c, ck)
    chunk = "chunk-000000.bin"
    check(os.path.isfile(os.path.join(ck, chunk)), f"no {chunk} in {sorted(os.listdir(ck))}")
    control = c.path("copy")
    shutil.copytree(ck, control, symlinks=True)
    expect_ok(c, c.train("--steps", "4", "--resume", control))

    def fifo(path):
        os.remove(path)
        os.mkfifo(path)

    def zero_link(path):
        os.remove(path)
        os.symlink("/dev/zero", path)

    def directory(path):
        os.remove(path)
        os.mkdir(path)

    variants = [("manifest.json a FIFO", "manifest.json", fifo, "FIFO"),
                (f"{chunk} a FIFO", chunk, fifo, "FIFO"),
                ("manifest.json a link to /dev/zero", "manifest.json", zero_link,
                 "not a regular file"),
                (f"{chunk} a directory", chunk, directory, "directory")]
    failures = []
    for i, (what, name, plant, needle) in enumerate(variants):
        bad = c.path(f"bad{i}")
        shutil.copytree(ck, bad, symlinks=True)
        plant(os.path.join(bad, name))
        before = snapshot(c.dir)
        try:
            r = c.train("--steps", "4", "--resume", bad, timeout=60)
            expect_refused(c, r, 1, needle)
            assert_unchanged(before, snapshot(c.dir), c.dir)
        except Failure as e:
            failures.append(f"{what}: {e}")
    check(not failures, "\n".join(failures))


# ---------------------------------------------------------------------------------------------
# 10. Config and data inputs


def config_dev_zero(c):
    expect_refused(c, c.strata("config", "check", "/dev/zero", timeout=60), 1,
                   "not a regular file")


def config_too_large(c):
    big = c.path("big.json")
    with open(big, "w") as f:
        f.write("{" + " " * (20 << 20) + "}\n")
    expect_refused(c, c.strata("config", "check", big, timeout=60), 1, "larger than")


def data_directory(c):
    os.mkdir(c.path("texts"))
    before = snapshot(c.dir)
    expect_refused(c, c.train("--steps", "2", "--data", c.path("texts")), 1, "directory")
    assert_unchanged(before, snapshot(c.dir), c.dir)


def config_huge_block(c):
    config = c.path("strata.json")
    with open(config, "w") as f:
        json.dump({"nvme": {"block_size": "1TiB"}}, f)
    expect_refused(c, c.strata("config", "check", config, timeout=60), 1)


# ---------------------------------------------------------------------------------------------
# 11. Messages


def precision_message(c):
    ck = c.path("ck")
    save_checkpoint(c, ck, "--precision", "fp32")
    before = snapshot(c.dir)
    r = c.train("--steps", "4", "--resume", ck, "--precision", "bf16")
    expect_refused(c, r, 1, "fp32", "precision")
    assert_unchanged(before, snapshot(c.dir), c.dir)
    return r.stderr.strip().splitlines()[-1]


def metrics_localhost(c):
    expect_ok(c, c.train("--steps", "2", "--metrics-port", "0", "--metrics-address", "localhost"))


def metrics_negative_port(c):
    expect_refused(c, c.train("--steps", "2", "--metrics-port", "-5"), 2, "metrics-port")


# ---------------------------------------------------------------------------------------------

CASES = [
    ("1a", "--checkpoint on a folder of notes", checkpoint_into_user_folder),
    ("1b", "--checkpoint through a link to it", checkpoint_through_link),
    ("1c", "--checkpoint and --nvme-path one folder", checkpoint_is_nvme_path),
    ("1d", "--checkpoint on the corpus' folder", checkpoint_holds_corpus),
    ("1e", "a user's file inside a checkpoint", user_file_in_checkpoint),
    ("1f", "an empty folder, then saved over", empty_folder_then_resave),
    ("2a", "bench nvme on a user's 1 MiB file", bench_user_file_small),
    ("2b", "bench nvme on a user's 16 MiB file", bench_user_file_large),
    ("2c", "bench nvme on a link and /dev/null", bench_not_regular),
    ("2d", "bench nvme on its own file", bench_own_file),
    ("2e", "bench all --out over a user's files", bench_all_out_foreign),
    ("3", "user files named like swap files", swap_leftovers),
    ("4a", "SIGINT with a checkpoint", sigint_with_checkpoint),
    ("4b", "SIGTERM with a checkpoint", sigterm_with_checkpoint),
    ("4c", "SIGINT with scratch swap", sigint_scratch),
    ("4d", "two SIGINTs", double_sigint),
    ("4e", "a live run's scratch folder", live_scratch_kept),
    ("5", "nothing left after an end or an error", clean_end),
    ("6", "--checkpoint as a relative name", relative_checkpoint),
    ("7a", "--checkpoint under a missing parent", missing_parent),
    ("7b", "--checkpoint on a read-only file system", read_only_parent),
    ("7c", "--checkpoint /proc/x", proc_checkpoint),
    ("8", "manifest values edited", manifest_checksum),
    ("9", "FIFOs, links and folders on --resume", hostile_resume_files),
    ("10a", "config check /dev/zero", config_dev_zero),
    ("10b", "a 20 MiB config", config_too_large),
    ("10c", "--data a folder", data_directory),
    ("10d", "config nvme.block_size 1TiB", config_huge_block),
    ("11a", "fp32 checkpoint resumed as bf16", precision_message),
    ("11b", "--metrics-address localhost", metrics_localhost),
    ("11c", "--metrics-port -5", metrics_negative_port),
]


def main():
    only = set(sys.argv[2:])  # Case numbers to run (all when none are given).
    passed, failed = 0, []
    for number, title, run_case in CASES:
        if only and number not in only:
            continue
        case = Case()
        start = time.monotonic()
        try:
            note = run_case(case)
            passed += 1
            print(f"ok   {number:>3} {title} ({time.monotonic() - start:.1f} s)" +
                  (f": {note}" if note else ""), flush=True)
        except Skip as why:
            passed += 1
            print(f"skip {number:>3} {title}: {why}", flush=True)
        except Failure as e:
            failed.append(number)
            print(f"FAIL {number:>3} {title}: {e}", flush=True)
        except Exception:  # A bug here or a surprise there: report it as this case's failure.
            failed.append(number)
            print(f"FAIL {number:>3} {title}:\n{traceback.format_exc()}", flush=True)
        finally:
            case.cleanup()
    if _corpus and os.path.basename(os.path.dirname(_corpus)).startswith("strata-safety-"):
        shutil.rmtree(os.path.dirname(_corpus), ignore_errors=True)
    print(f"{passed} passed, {len(failed)} failed" +
          (f" ({', '.join(failed)})" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
