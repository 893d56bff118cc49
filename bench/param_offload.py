#!/usr/bin/env python3
"""What keeping the parameters off the device costs a training step
(strata.torch.offload_parameters), ratios measured in one run (PERFORMANCE.md).

One training step (forward, backward, OffloadAdamW's step with states in host memory) of the
example GPT (examples/python/train_gpt.py) with its parameters resident, against the same step
with them in host memory and on NVMe and the device holding a quarter of the parameters and
gradients. Target: offloaded step / resident step <= 1.15 where copies are not the slowest
resource (here: CPU tensors, a model whose matrix products outweigh copying its parameters).
Also per step: parameter bytes fetched per tier, seconds the loop waited for a fetch, the
device's peak against its budget, and the parameters filled for running modules at once.

Settings run in turn, round after round, and each ratio is the median of its rounds' ratios
(a shared machine's speed drifts over seconds).

    PYTHONPATH=build/release/python python bench/param_offload.py [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import strata.torch as st

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python" / "train_gpt.py"


def example_gpt() -> type:
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    gpt = example_gpt()
    scratch = tempfile.TemporaryDirectory(prefix="strata-bench-")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.context + 1), generator=generator)

    def build(params: str | None):
        torch.manual_seed(0)
        model = gpt(args.context, args.width, args.layers, heads=6)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        budget = 2 * size // 4
        chunk = max(4096, size // 32 // 4096 * 4096)
        if params is not None:
            st.offload_parameters(model, params, nvme_path=scratch.name, device_memory=budget)
        opt = st.OffloadAdamW(model.parameters(), lr=1e-4, chunk_size=chunk)
        return model, opt, size, budget

    settings = {"resident": build(None), "params_host": build("cpu"),
                "params_nvme": build("nvme")}

    def step(model, opt) -> None:
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).reshape(-1, 256),
                                           tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for model, opt, _, _ in settings.values():  # Warm-up: first touch, the order recorded.
        step(model, opt)
        step(model, opt)
    before = {name: s[1].metrics() for name, s in settings.items()}
    times = {name: [] for name in settings}
    for _ in range(args.rounds):
        for name, (model, opt, _, _) in settings.items():
            start = time.perf_counter()
            step(model, opt)
            times[name].append(time.perf_counter() - start)

    size = settings["resident"][2]
    result = {"parameters": sum(p.numel() for p in settings["resident"][0].parameters()),
              "parameter_bytes": size, "resident_step_seconds": statistics.median(times["resident"])}
    for name in ("params_host", "params_nvme"):
        _, opt, _, budget = settings[name]
        now, then = opt.metrics(), before[name]
        per_step = {k: (now[k] - then[k]) / args.rounds
                    for k in ("fetched_from_host_bytes", "fetched_from_nvme_bytes",
                              "fetch_stall_seconds")}
        ratios = [t / r for t, r in zip(times[name], times["resident"])]
        result[name] = {
            "step_seconds": statistics.median(times[name]),
            "step_ratio": statistics.median(ratios),
            "device_budget_bytes": budget,
            "device_peak_bytes": now["device_peak_bytes"],
            "filled_param_peak_bytes": now["filled_param_peak_bytes"],
            **per_step,
        }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"example GPT: {result['parameters'] / 1e6:.2f}M fp32 parameters "
          f"({size / 2**20:.1f} MiB, {2 * size / 2**20:.1f} MiB with gradients); resident step "
          f"{result['resident_step_seconds'] * 1e3:.1f} ms")
    print(f"{'parameters on':<14}{'step / resident':>16}{'fetched MiB/step':>18}"
          f"{'waited ms/step':>16}{'device peak / budget MiB':>26}{'filled peak MiB':>17}")
    for name, label in (("params_host", "host"), ("params_nvme", "nvme")):
        r = result[name]
        fetched = r["fetched_from_host_bytes"] + r["fetched_from_nvme_bytes"]
        print(f"{label:<14}{r['step_ratio']:>16.3f}{fetched / 2**20:>18.1f}"
              f"{r['fetch_stall_seconds'] * 1e3:>16.1f}"
              f"{r['device_peak_bytes'] / 2**20:>14.1f} / {r['device_budget_bytes'] / 2**20:<9.1f}"
              f"{r['filled_param_peak_bytes'] / 2**20:>17.1f}")


if __name__ == "__main__":
    main()
