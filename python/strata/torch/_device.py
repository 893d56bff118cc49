"""The device a strata optimizer's parameters are on, as engine calls need it: torch's current
device around a call, and the trainer's stream the engine orders its work after. Functions of
the device alone, so that what holds them (a residency's hooks) holds no optimizer."""

from __future__ import annotations

import contextlib

import torch


def trainer_stream(device: torch.device) -> int:
    """The native handle of torch's current stream on `device` (engine.h's TrainerStream)."""
    if device.type != "cuda":
        return 0  # CPU tensors: torch's work is done when a hook runs.
    # torch's legacy default stream has handle 0, which the engine reads as its own compute
    # stream; cudaStreamLegacy (1) names the legacy stream explicitly.
    return torch.cuda.current_stream(device).cuda_stream or 1


def selected(device: torch.device) -> contextlib.AbstractContextManager:
    """Engine calls select the parameters' GPU on the calling thread; this puts torch's current
    device back afterwards."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
