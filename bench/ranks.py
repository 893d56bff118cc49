#!/usr/bin/env python3
"""strata.torch across ranks: what each rank holds and does with 1, 2 and 3 ranks, and the
training step against forward + backward alone (PERFORMANCE.md: ratios measured in one run).

Each world size runs under torchrun (gloo, CPU tensors) an MLP of --layers Linear layers of
--width, each layer its own FSDP2 unit (fully_shard), or wrapped in DDP with shard_states=True
(--wrap ddp). Per rank, from the engine's counters: host memory the optimizer holds (its host
tier, states and staging), NVMe bytes written per step, parameters the CPU optimizer updates per
step — each about 1/N of one rank's — and its seconds per step, which also grow with the
contention for this machine's cores. Then the step ratio: forward + backward + OffloadAdamW.step()
against forward + backward alone on the same sharded model, and torch AdamW's step on it for
comparison, run in turn round after round (each ratio the median of the rounds'). The ranks
share this machine's cores, so forward + backward itself slows as N grows; the ratios do not
depend on that.

    PYTHONPATH=build/release/python python bench/ranks.py [--ranks 1 2 3] [--offload nvme]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import strata.torch as st

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def model() -> nn.Module:
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.GELU()]
        net = nn.Sequential(*layers)
        if args.wrap == "ddp":
            return DistributedDataParallel(net)
        mesh = init_device_mesh("cpu", (world,))
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    x = torch.randn(args.batch // world, args.width, generator=torch.Generator().manual_seed(rank))

    def step(net, opt):
        def run():
            net(x).square().mean().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                net.zero_grad()
        return run

    with tempfile.TemporaryDirectory() as nvme:
        nets = {name: model() for name in ("alone", "strata", "torch")}
        strata = st.OffloadAdamW(nets["strata"].parameters(), lr=1e-4, offload=args.offload,
                                 nvme_path=nvme, chunk_size=args.chunk_size,
                                 shard_states=args.wrap == "ddp",
                                 speculative_updates=args.speculative or None)
        runs = {"alone": step(nets["alone"], None),
                "strata": step(nets["strata"], strata),
                "torch": step(nets["torch"], torch.optim.AdamW(nets["torch"].parameters(),
                                                               lr=1e-4))}
        for run in runs.values():  # Warm-up: first touch, FSDP2's lazy init.
            run()
        before = strata.metrics()
        times = {name: [] for name in runs}
        for _ in range(args.repeats):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        after = strata.metrics()
        del strata

    def per_step(key: str) -> float:
        return (after[key] - before[key]) / args.repeats

    def median_ratio(numerator: str) -> float:
        return statistics.median(a / b for a, b in zip(times[numerator], times["alone"]))

    mine = torch.tensor([after["host_used_bytes"], per_step("nvme_write_bytes"),
                         per_step("optimizer_seconds"), statistics.median(times["alone"]),
                         per_step("optimizer_params")],
                        dtype=torch.float64)
    largest = mine.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # The busiest rank's.
    ratios = torch.tensor([median_ratio("strata"), median_ratio("torch")], dtype=torch.float64)
    dist.all_reduce(ratios, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(json.dumps({
            "ranks": world,
            "params": args.layers * (args.width * args.width + args.width),
            "host_bytes_per_rank": largest[0].item(),
            "nvme_write_bytes_per_step_per_rank": largest[1].item(),
            "optimizer_seconds_per_step_per_rank": largest[2].item(),
            "forward_backward_seconds": largest[3].item(),
            "optimizer_params_per_step_per_rank": largest[4].item(),
            "step_ratio": ratios[0].item(),
            "torch_adamw_step_ratio": ratios[1].item(),
        }), flush=True)
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--wrap", choices=["fsdp2", "ddp"], default="fsdp2")
    parser.add_argument("--offload", choices=["cpu", "nvme"], default="cpu")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=384, help="global batch, split by the ranks")
    parser.add_argument("--chunk-size", default="2MiB")
    parser.add_argument("--repeats", type=int, default=7, help="rounds")
    parser.add_argument("--speculative", action="store_true",
                        help="speculative_updates=True: updates during backward")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results = []
    for ranks in args.ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={ranks}", __file__, "--worker", "--wrap", args.wrap,
                   "--offload", args.offload, "--width", str(args.width), "--layers",
                   str(args.layers), "--batch", str(args.batch), "--chunk-size", args.chunk_size,
                   "--repeats", str(args.repeats), *(["--speculative"] if args.speculative else [])]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{ranks} ranks failed:\n{run.stderr[-4000:]}")
        results.append(json.loads(run.stdout.splitlines()[-1]))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    one = results[0]
    print(f"{args.wrap}, states in {'host memory' if args.offload == 'cpu' else 'NVMe'}, "
          f"{one['params']:,} parameters; per rank (the busiest), and against {one['ranks']} "
          "rank(s):")
    print(f"{'ranks':>5} {'host MiB':>9} {'x':>5} {'NVMe MiB/step':>14} {'x':>5} "
          f"{'Adam M/step':>12} {'x':>5} {'Adam s/step':>12} {'x':>5} {'fwd+bwd s':>10} "
          f"{'step/fwd+bwd':>13} {'torch AdamW':>12}")
    for r in results:
        def share(key: str) -> str:
            return f"{r[key] / one[key]:5.2f}" if one[key] else "    -"
        print(f"{r['ranks']:>5} {r['host_bytes_per_rank'] / 2**20:9.1f} "
              f"{share('host_bytes_per_rank')} "
              f"{r['nvme_write_bytes_per_step_per_rank'] / 2**20:14.1f} "
              f"{share('nvme_write_bytes_per_step_per_rank')} "
              f"{r['optimizer_params_per_step_per_rank'] / 1e6:12.2f} "
              f"{share('optimizer_params_per_step_per_rank')} "
              f"{r['optimizer_seconds_per_step_per_rank']:12.4f} "
              f"{share('optimizer_seconds_per_step_per_rank')} "
              f"{r['forward_backward_seconds']:10.3f} {r['step_ratio']:13.3f} "
              f"{r['torch_adamw_step_ratio']:12.3f}")


if __name__ == "__main__":
    main()
