"""Run by test_frameworks in processes of their own: the HF Trainer (default arguments, so
clipping at 1.0) training a small GPT-2 for 12 steps with a checkpoint every 6, or resuming
from one of those checkpoints in a new process; saves the final parameters.

    python hf_resume.py strata|torch OUT_DIR [CHECKPOINT]"""

import sys

import torch
import transformers

import strata.torch as st
from test_frameworks import Tokens, tiny_gpt2

kind, out = sys.argv[1], sys.argv[2]
resume = sys.argv[3] if len(sys.argv) > 3 else None
model = tiny_gpt2()
opt = (st.OffloadAdamW(model.parameters(), lr=1e-3) if kind == "strata"
       else torch.optim.AdamW(model.parameters(), lr=1e-3))
args = transformers.TrainingArguments(
    output_dir=out, per_device_train_batch_size=2, learning_rate=1e-3, seed=0, max_steps=12,
    save_strategy="steps", save_steps=6, logging_steps=1, report_to=[], use_cpu=True,
    disable_tqdm=True, dataloader_num_workers=0)
trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(40),
                               optimizers=(opt, None))
trainer.train(resume_from_checkpoint=resume)
torch.save([p.detach().clone() for p in model.parameters()], f"{out}/final.pt")
