#!/usr/bin/env python3
"""The optimizer's threads and torch's OpenMP threads sharing busy cores: the training step of
examples/python/train_gpt.py's model (its defaults: 0.8M parameters, batch 8 x 128, clipping at
1.0) with OffloadAdamW (states on NVMe and in host memory) against the same loop with
torch.optim.AdamW, while `--busy` other processes spin on the CPU (a shared machine, a data
loader). Target: OffloadAdamW's step / torch's <= 1.3.

Each setting runs in a process of its own, in turn, round after round (the busy processes
running throughout); a round's figure is the median step time after the first steps, and the
ratio is the median over rounds of each round's ratio, so the machine's drift lands in no one
setting (PERFORMANCE.md).

    PYTHONPATH=build/release/python python bench/contention.py [--busy 2] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import textwrap

HERE = pathlib.Path(__file__).resolve().parent

# One setting's run: prints the median step time of its steps after the first three.
RUN = textwrap.dedent("""
    import statistics, sys, tempfile, time
    import torch
    from torch import nn
    sys.path.insert(0, sys.argv[3])
    import train_gpt as tg
    import strata.torch as st
    kind, steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    model = tg.GPT(128, 128, 4, 4)
    groups = tg.param_groups(model, 3e-3, 0.1)
    if kind == "torch":
        opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95))
    else:
        opt = st.OffloadAdamW(groups, lr=3e-3, betas=(0.9, 0.95), offload=kind,
                              nvme_path=tempfile.mkdtemp(), chunk_size="1MiB")
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (100000,), generator=g)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        first = torch.randint(0, len(data) - 130, (8,), generator=g)
        w = torch.stack([data[i:i + 129] for i in first])
        loss = nn.functional.cross_entropy(model(w[:, :-1]).reshape(-1, 256),
                                           w[:, 1:].reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # As the frameworks do by default.
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    print(statistics.median(times[3:]))
""")


def step_seconds(kind: str, steps: int) -> float:
    done = subprocess.run([sys.executable, "-c", RUN, kind, str(steps),
                           str(HERE.parent / "examples" / "python")],
                          capture_output=True, text=True, timeout=1800, check=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(args.busy)]
    kinds = ("torch", "nvme", "cpu")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for _ in range(args.rounds):
            for kind in kinds:
                times[kind].append(step_seconds(kind, args.steps))
    finally:
        for spinner in spinners:
            spinner.kill()
    results = {"busy_processes": args.busy, "rounds": args.rounds,
               "torch_step_seconds": statistics.median(times["torch"])}
    for kind in ("nvme", "cpu"):
        results[f"{kind}_step_seconds"] = statistics.median(times[kind])
        results[f"{kind}_ratio"] = statistics.median(
            a / b for a, b in zip(times[kind], times["torch"]))
    results["target"] = "ratio <= 1.3"
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"train_gpt's step beside {args.busy} busy processes (median of {args.rounds} rounds)")
    print(f"  torch.optim.AdamW                  {results['torch_step_seconds']:.4f} s")
    for kind in ("nvme", "cpu"):
        print(f"  OffloadAdamW, offload={kind!r:<7}     {results[f'{kind}_step_seconds']:.4f} s"
              f"  x{results[f'{kind}_ratio']:.2f}")
    print("  target: <= 1.3 x torch")


if __name__ == "__main__":
    main()
