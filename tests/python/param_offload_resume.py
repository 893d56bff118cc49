"""Run by test_param_offload in a fresh process: offloads a new model's parameters to NVMe,
loads the model's and the optimizer's state_dicts saved half-way, trains the remaining steps
and saves the losses and the model's state_dict."""

import sys

import torch

import offload_models as models
import strata.torch as st
from test_param_offload import CHUNK, LR, WEIGHT_DECAY, device_memory_for

checkpoint, nvme_path, first, last, clip, out = sys.argv[1:]
saved = torch.load(checkpoint)
model = models.make("gpt")
st.offload_parameters(model, "nvme", nvme_path=nvme_path, device_memory=device_memory_for(model))
opt = st.OffloadAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, offload="nvme",
                      nvme_path=nvme_path, max_grad_norm=float(clip), chunk_size=CHUNK)
model.load_state_dict(saved["model"])
opt.load_state_dict(saved["optimizer"])
losses = models.train("gpt", model, opt, range(int(first), int(last)))
torch.save({"losses": losses, "model": model.state_dict()}, out)
