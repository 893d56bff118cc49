"""Run by test_equivalence in a fresh process: builds the model and OffloadAdamW, loads the
state_dicts saved half-way, trains the remaining steps and saves the parameters."""

import sys

import torch

import training

kind, checkpoint, nvme_path, first, last, out = sys.argv[1:]
saved = torch.load(checkpoint, weights_only=False)
model = training.make_model(kind)
model.load_state_dict(saved["model"])
opt = training.make_optimizer("nvme", model, lr=saved["lr"], max_grad_norm=saved["max_grad_norm"],
                              gas=saved["gas"], nvme_path=nvme_path)
opt.load_state_dict(saved["optimizer"])
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=saved["t_max"])
scheduler.load_state_dict(saved["scheduler"])
training.train(kind, model, opt, scheduler, range(int(first), int(last)), gas=saved["gas"],
               max_grad_norm=saved["max_grad_norm"])
torch.save([p.detach().clone() for p in model.parameters()], out)
