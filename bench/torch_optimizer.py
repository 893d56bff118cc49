#!/usr/bin/env python3
"""strata.torch.OffloadAdamW against torch.optim.AdamW, ratios measured in one run
(PERFORMANCE.md).

1. Update throughput on CPU tensors: parameters/s of one optimizer update over --params fp32
   parameters, against torch.optim.AdamW(fused=True) on tensors of the same size (target:
   >= 2x), and against torch.optim.AdamW with its defaults (on CPU, a loop over the tensors).
   The update is handed to Strata by backward (its hooks), so its time is (backward + step)
   minus the same backward without an optimizer; torch's is step() alone. The memory-bandwidth
   roofline is measured in the same run (`strata bench adam`'s kernel that moves the 28 bytes
   per parameter an fp32 AdamW step must move, and Strata's CPU Adam kernel alone beside it):
   no update can beat the roofline, so the >= 2x target needs fused AdamW below half of it.
2. Overlap: one training step (forward, backward, step) of an MLP whose backward outweighs the
   update, against forward + backward alone, with the update overlapping backward
   (overlap=True) and after it (overlap=False). Target: overlapped <= 1.10x backward alone.
   Then the frameworks' default, clip_grad_norm_(max_norm=1.0) between backward and step(), on
   steps that do not clip (it multiplies by exactly 1: the updates made during backward stand;
   same target) and on steps that clip (every chunk's update is redone after backward), each
   against forward + backward + the same clip_grad_norm_ without an optimizer.

Settings compared with each other run in turn, round after round, and each ratio is the median
of its rounds' ratios: a shared machine's speed drifts over seconds, and a setting timed in one
block after another would carry that drift into the ratio.

    PYTHONPATH=build/release/python python bench/torch_optimizer.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from torch import nn

from strata import bench_adam
import strata.torch as st


def seconds(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def interleaved(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Each run's seconds in `repeats` rounds, every round running each once in turn, after a
    warm-up round (first touch, the engine's first-step order recording)."""
    for run in runs.values():
        run()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    return times


def median_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float:
    return statistics.median(a / b for a, b in zip(times[numerator], times[denominator]))


def flat_parameters(total: int, tensors: int) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(total // tensors) * 0.02) for _ in range(tensors)]


def update_throughput(args) -> dict:
    coefficients = [torch.randn(args.params // args.tensors) for _ in range(args.tensors)]

    def backward(params):
        sum((p * c).sum() for p, c in zip(params, coefficients)).backward()

    # torch: step() alone, gradients already there.
    fused_params = flat_parameters(args.params, args.tensors)
    backward(fused_params)
    fused = torch.optim.AdamW(fused_params, lr=1e-3, fused=True)
    default_params = flat_parameters(args.params, args.tensors)
    backward(default_params)
    default = torch.optim.AdamW(default_params, lr=1e-3)

    # The same backward with no optimizer: what Strata's (backward + step) is measured against.
    plain = flat_parameters(args.params, args.tensors)

    def backward_only():
        backward(plain)
        for p in plain:
            p.grad = None

    params = flat_parameters(args.params, args.tensors)
    # Every core, as torch's fused AdamW uses them (CPU tensors default to half: _options.py).
    strata = st.OffloadAdamW(params, lr=1e-3, offload="cpu", chunk_size=args.chunk_size,
                             cpu_threads=torch.get_num_threads())

    def strata_update():
        backward(params)
        strata.step()
        strata.zero_grad()

    times = interleaved({"fused": fused.step, "default": default.step,
                         "backward": backward_only, "strata": strata_update}, args.repeats)
    # Strata's update, each round: (backward + step) - backward alone.
    times["update"] = [max(t - b, 1e-9) for t, b in zip(times["strata"], times["backward"])]
    torch_step = statistics.median(times["fused"])
    torch_default_step = statistics.median(times["default"])
    backward_alone = statistics.median(times["backward"])
    total = statistics.median(times["strata"])
    strata_update_seconds = statistics.median(times["update"])
    ratio = median_ratio(times, "fused", "update")
    ratio_to_default = median_ratio(times, "default", "update")
    counters = strata.metrics()
    del strata, params, fused, default, fused_params, default_params, plain

    kernel = bench_adam(args.params, threads=torch.get_num_threads(), runs=args.repeats)
    roofline = kernel["roofline_seconds"]
    return {
        "params": args.params,
        "torch_fused_step_seconds": torch_step,
        "torch_fused_params_per_second": args.params / torch_step,
        "backward_alone_seconds": backward_alone,
        "strata_backward_and_step_seconds": total,
        "strata_update_seconds": strata_update_seconds,
        "strata_params_per_second": args.params / strata_update_seconds,
        "ratio": ratio,
        "target": ">= 2",
        "torch_default_step_seconds": torch_default_step,
        "torch_default_params_per_second": args.params / torch_default_step,
        "ratio_to_default": ratio_to_default,
        # Zero copy on CPU tensors: what crossed between "device" and host memory, per step.
        "device_to_host_bytes_per_step": counters["device_to_host_bytes"] / (args.repeats + 1),
        "host_to_device_bytes_per_step": counters["host_to_device_bytes"] / (args.repeats + 1),
        "roofline_seconds": roofline,
        "roofline_params_per_second": args.params / roofline,
        "roofline_bytes_per_param": kernel["bytes_per_param"],
        "torch_fused_of_roofline": roofline / torch_step,
        "strata_kernel_seconds": kernel["step_seconds"],
        "strata_kernel_of_roofline": roofline / kernel["step_seconds"],
        "strata_kernel_ratio": torch_step / kernel["step_seconds"],
        "strata_update_of_roofline": roofline / strata_update_seconds,
        "best_possible_ratio": torch_step / roofline,
    }


def overlap(args) -> dict:
    def model():
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [nn.Linear(args.width, args.width), nn.GELU()]
        return nn.Sequential(*layers)

    x = torch.randn(args.batch, args.width)

    def step(net, opt, max_norm=None):
        def run():
            net(x).square().mean().backward()
            if max_norm is not None:
                nn.utils.clip_grad_norm_(net.parameters(), max_norm)
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                net.zero_grad()
        return run

    plain = model()
    net = model()
    net(x).square().mean().backward()
    norm = float(nn.utils.clip_grad_norm_(net.parameters(), float("inf")))
    # The frameworks' default max_norm, 1.0, where this model's gradients are below it; a
    # hundredth of the norm where they must clip.
    not_clipping, clipping = max(1.0, 2 * norm), norm / 100
    runs = {"alone": step(plain, None), "alone_clip": step(plain, None, not_clipping)}
    # (overlap, speculative_updates, max_norm): the overlap measured is the speculative one
    # (updates during backward); "default" is what CPU tensors get by default (they wait).
    cases = {"overlapped": (True, True, None), "after_backward": (False, True, None),
             "default": (True, None, None), "clip_not_clipping": (True, True, not_clipping),
             "clip_clipping": (True, True, clipping)}
    references = {"clip_not_clipping": "alone_clip", "clip_clipping": "alone_clip"}
    optimizers = {}
    nets = {}
    with tempfile.TemporaryDirectory() as nvme:
        for name, (overlapped, speculative, max_norm) in cases.items():
            nets[name] = model()
            optimizers[name] = st.OffloadAdamW(
                nets[name].parameters(), lr=1e-4, offload=args.offload, nvme_path=nvme,
                chunk_size=args.chunk_size, overlap=overlapped, speculative_updates=speculative)
            runs[name] = step(nets[name], optimizers[name], max_norm)
        times = interleaved(runs, args.repeats)
        results = {"params": sum(p.numel() for p in plain.parameters()),
                   "forward_backward_seconds": statistics.median(times["alone"]),
                   "forward_backward_clip_seconds": statistics.median(times["alone_clip"]),
                   "grad_norm": norm}
        for name, opt in optimizers.items():
            results[f"{name}_step_seconds"] = statistics.median(times[name])
            results[f"{name}_ratio"] = median_ratio(times, name, references.get(name, "alone"))
            results[f"{name}_optimizer_busy_seconds_per_step"] = (
                opt.metrics()["optimizer_seconds"] / (args.repeats + 1))
            results[f"{name}_redone_updates"] = opt.metrics()["rolled_back_updates"]
        del optimizers, nets, runs
    results["target"] = "overlapped_ratio and clip_not_clipping_ratio <= 1.10"
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=64 << 20, help="parameters (update part)")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--offload", choices=["cpu", "nvme"], default="cpu")
    parser.add_argument("--chunk-size", default="4MiB")
    parser.add_argument("--repeats", type=int, default=9, help="rounds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()

    update = update_throughput(args)
    steps = overlap(args)
    if args.json:
        print(json.dumps({"update": update, "overlap": steps,
                          "torch": torch.__version__, "threads": torch.get_num_threads()},
                         indent=2))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU tensors")
    print(f"update of {update['params'] / 2**20:.0f}Mi fp32 parameters")
    print(f"  torch.optim.AdamW(fused=True) step     {update['torch_fused_step_seconds']:8.4f} s"
          f"  {update['torch_fused_params_per_second'] / 1e6:8.1f} M params/s")
    print(f"  OffloadAdamW (backward+step - backward) {update['strata_update_seconds']:8.4f} s"
          f"  {update['strata_params_per_second'] / 1e6:8.1f} M params/s")
    print(f"  ratio (target >= 2)                      {update['ratio']:8.2f}")
    print(f"  torch.optim.AdamW() (defaults) step      {update['torch_default_step_seconds']:8.4f} s"
          f"  {update['torch_default_params_per_second'] / 1e6:8.1f} M params/s")
    print(f"  ratio to the defaults                    {update['ratio_to_default']:8.2f}")
    print(f"  memory roofline ({update['roofline_bytes_per_param']} B/param)          "
          f"{update['roofline_seconds']:8.4f} s  {update['roofline_params_per_second'] / 1e6:8.1f}"
          f" M params/s")
    print(f"  fused AdamW runs at                      {update['torch_fused_of_roofline']:8.2f}"
          f" of the roofline (best possible ratio {update['best_possible_ratio']:.2f})")
    print(f"  Strata's CPU Adam kernel alone           {update['strata_kernel_seconds']:8.4f} s"
          f"  {update['strata_kernel_of_roofline']:.2f} of the roofline, "
          f"x{update['strata_kernel_ratio']:.2f} fused")
    print(f"  OffloadAdamW's update runs at            {update['strata_update_of_roofline']:8.2f}"
          f" of the roofline")
    print(f"  copied device -> host / host -> device   "
          f"{update['device_to_host_bytes_per_step'] / 2**20:.1f} / "
          f"{update['host_to_device_bytes_per_step'] / 2**20:.1f} MiB per step")
    print(f"training step of a {args.layers}-layer MLP, width {args.width}, batch {args.batch} "
          f"({steps['params'] / 1e6:.1f}M params, states on {args.offload})")
    print(f"  forward + backward alone                 {steps['forward_backward_seconds']:8.4f} s")
    print(f"  forward + backward + clip_grad_norm_     {steps['forward_backward_clip_seconds']:8.4f} s"
          f"  (gradient norm {steps['grad_norm']:.3g})")
    for name in ("overlapped", "after_backward", "default", "clip_not_clipping", "clip_clipping"):
        print(f"  with OffloadAdamW, {name:<21} {steps[f'{name}_step_seconds']:8.4f} s"
              f"  x{steps[f'{name}_ratio']:.3f}  (CPU optimizer busy "
              f"{steps[f'{name}_optimizer_busy_seconds_per_step']:.4f} s/step)")
    print("  target: overlapped <= 1.10 x forward + backward alone "
          "(ratios: medians of per-round ratios)")


if __name__ == "__main__":
    main()
