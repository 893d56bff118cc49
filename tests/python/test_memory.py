"""Host memory against torch.optim.AdamW's, measured as peak RSS of a training run in a process
of its own. offload="cpu" costs what torch costs plus the fp32 states it keeps (master,
exp_avg, exp_avg_sq), within 10%. With speculative_updates=True (off by default on CPU tensors)
the updates made during backward keep their new states in a second buffer until step(), where
they can still be redone: one more copy of the states at most. offload="nvme", chosen to save
memory, costs less than "cpu" (its staging holds a few chunks' states)."""

import subprocess
import sys
import textwrap

WIDTH, LAYERS = 1280, 8  # 13.1M parameters: 50 MiB in fp32, 150 MiB of states.

RUN = textwrap.dedent(f"""
    import resource, sys, tempfile
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear({WIDTH}, {WIDTH}) for _ in range({LAYERS})])
    kind = sys.argv[1]
    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        import strata.torch as st
        offload = kind.removesuffix("_speculating")
        opt = st.OffloadAdamW(model.parameters(), lr=1e-3, offload=offload,
                              nvme_path=tempfile.mkdtemp() if offload == "nvme" else None,
                              speculative_updates=True if kind.endswith("_speculating") else None)
    x = torch.randn(64, {WIDTH})
    for _ in range(5):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
""")


def peak_rss(kind: str) -> int:
    done = subprocess.run([sys.executable, "-c", RUN, kind], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_cpu_costs_torchs_memory_plus_its_states_and_nvme_less():
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    states = 12 * params  # fp32 master, exp_avg, exp_avg_sq.
    torch_rss, cpu_rss, nvme_rss = peak_rss("torch"), peak_rss("cpu"), peak_rss("nvme")
    speculating_rss = peak_rss("cpu_speculating")
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    figures = (f"torch AdamW {mib(torch_rss)}, offload='cpu' {mib(cpu_rss)} "
               f"({mib(speculating_rss)} with speculative_updates=True), "
               f"offload='nvme' {mib(nvme_rss)}, states {mib(states)}")
    print(figures)
    assert cpu_rss <= 1.1 * (torch_rss + states), figures
    assert speculating_rss <= 1.1 * (torch_rss + 2 * states), figures
    assert nvme_rss < cpu_rss, figures
