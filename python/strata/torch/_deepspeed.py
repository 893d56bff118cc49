"""strata.torch.initialize: ``deepspeed.initialize``'s shape, on Strata's engine.

A DeepSpeed config is read by the engine's own parser, so it is checked exactly as
``strata config check`` checks it (an unknown key, a typo, an unsupported combination: the same
error). Its sections then become what a strata.torch user would write by hand:

* ``optimizer`` -> OffloadAdamW / OffloadAdam / OffloadAdagrad / OffloadLion with its params;
* ``zero_optimization.offload_optimizer`` -> the optimizer's ``offload``, ``nvme_path``,
  ``offload_ratio``; ``offload_param`` -> ``offload_parameters(model, ...)``;
* ``gradient_clipping`` -> ``max_grad_norm``; the batch keys -> ``gradient_accumulation_steps``;
* ``fp16`` / ``bf16`` -> the model cast to that dtype, with fp16's loss scaler settings;
* ``aio`` and the offload buffers -> the engine's NVMe and staging settings.

``"auto"`` (what the HF Trainer's DeepSpeed integration writes) is resolved from ``args`` when
it has the TrainingArguments field the HF integration would use, and refused naming the key
otherwise: a default standing in for a learning rate would train silently wrong.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from strata import _log
from strata.torch import _deepspeed_ranks as _ranks
from strata.torch import _native
from strata.torch import rules
from strata.torch._offload_plan import offload_parameters
from strata.torch._options import nvme_directory
from strata.torch.optimizer import OffloadOptimizer

_OPTIMIZERS = {"adamw": rules.OffloadAdamW, "adam": rules.OffloadAdam,
               "adagrad": rules.OffloadAdagrad, "lion": rules.OffloadLion}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_STATE_TIERS = {"host": "cpu", "nvme": "nvme", "device": None}
_PARAM_TIERS = {"host": "cpu", "nvme": "nvme"}


def _from_args(args: Any, world_size: int) -> dict[str, Callable[[], Any]]:
    """DeepSpeed keys the HF integration fills with "auto", and the TrainingArguments field
    each comes from (transformers.integrations.deepspeed's trainer_config_process)."""
    def get(name: str) -> Callable[[], Any]:
        return lambda: getattr(args, name)
    return {
        "train_micro_batch_size_per_gpu": get("per_device_train_batch_size"),
        "gradient_accumulation_steps": get("gradient_accumulation_steps"),
        "train_batch_size": lambda: (args.per_device_train_batch_size
                                     * args.gradient_accumulation_steps * world_size),
        "gradient_clipping": get("max_grad_norm"),
        "optimizer.params.lr": get("learning_rate"),
        "optimizer.params.betas": lambda: [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": get("adam_epsilon"),
        "optimizer.params.weight_decay": get("weight_decay"),
        "fp16.enabled": lambda: bool(args.fp16),
        "bf16.enabled": lambda: bool(args.bf16),
    }


def _without_comments(text: str) -> str:
    """JSON text with its // and /* */ comments (which the engine's parser allows) removed,
    strings left alone."""
    out, i, quoted = [], 0, False
    while i < len(text):
        c = text[i]
        if quoted:
            out.append(c)
            if c == "\\":
                out.append(text[i + 1:i + 2])
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
            out.append(c)
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = len(text) if i < 0 else i
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = len(text) if end < 0 else end + 2
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _check_against_args(document: dict, args: Any, source: str) -> None:
    """A value the config gives and `args` gives too must agree, as the HF integration
    requires (its "mismatch" error): a script whose arguments say one learning rate and whose
    config another would otherwise train with the config's without a word."""
    if args is None:
        return
    mismatches = []
    for key, value in _from_args(args, 1).items():
        if key == "train_batch_size":
            continue  # Needs the world size: DeepSpeed's own check covers it.
        node: Any = document
        for name in key.split("."):
            node = node.get(name) if isinstance(node, dict) else None
        if node is None or node == "auto":
            continue
        try:
            wanted = value()
        except AttributeError:
            continue
        same = (node == wanted if not isinstance(wanted, (int, float))
                or isinstance(wanted, bool) else math.isclose(float(node), float(wanted)))
        if not same:
            mismatches.append(f"{key}={node!r} but args say {wanted!r}")
    if mismatches:
        raise ValueError(f"{source}: the config and args disagree: " + "; ".join(mismatches)
                         + " (set the value in one place, or \"auto\" in the config)")


def load_config(config: Any, args: Any = None, world_size: int = 1) -> tuple[dict, dict]:
    """(what `strata config check` resolves `config` to, the document as a dict) with "auto"
    values resolved from `args` (see the module docstring). `config`: a path, or the document
    as a dict (DeepSpeed's config_params)."""
    if isinstance(config, dict):
        document, source = json.loads(json.dumps(config, default=os.fspath)), "<config dict>"
        loaded = _native.parse_config(json.dumps(document), "auto", source, world_size)
    else:
        source = os.fspath(config)
        loaded = _native.load_config(source, "auto", world_size)  # Its errors come first.
        with open(source, encoding="utf-8") as f:
            document = json.loads(_without_comments(f.read()))
    _check_against_args(document, args, source)
    autos = [note.split(": auto -> ")[0] for note in loaded["auto_resolved"]]
    if not autos:
        return loaded, document
    known = _from_args(args, world_size) if args is not None else {}
    values = {}
    for key in autos:
        try:
            values[key] = known[key]()
        except (KeyError, AttributeError):
            where = ("args has no TrainingArguments field for it" if args is not None
                     else "no args were given to resolve it from")
            raise ValueError(
                f"{source}: {key} is \"auto\" and {where}; give it a value in the config (the "
                "HF Trainer fills these in from its arguments)") from None
    for key, value in values.items():
        *parents, last = key.split(".")
        node = document
        for name in parents:
            node = node[name]
        node[last] = value
    return _native.parse_config(json.dumps(document), "auto", source, world_size), document


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None,
               lr_scheduler: Any = None, config: Any = None, config_params: Any = None,
               dist_init_required: bool | None = None,
               **unsupported: Any) -> tuple["ModelEngine", Any, None, Any]:
    """``deepspeed.initialize`` on Strata: returns ``(model_engine, optimizer, None,
    lr_scheduler)``. ``config`` is a DeepSpeed (or Strata) config file or dict
    (``config_params`` is DeepSpeed's other name for it; ``args.deepspeed_config``, or the HF
    Trainer's ``args.deepspeed``, is read when neither is given). ``optimizer``: None to build
    the config's ``optimizer`` section, or a callable taking the parameters and the config's
    settings as keywords and returning a strata optimizer (``lambda params, **settings:
    st.OffloadLion(params, lr=1e-4, **settings)``). ``lr_scheduler``: a scheduler, or a
    callable taking the optimizer; it steps after each optimizer step that fp16 did not skip.
    The model goes to this process's GPU when there is one, in the config's dtype. Started by
    torchrun, mpirun or srun, it creates the process group if there is none (as DeepSpeed;
    ``dist_init_required=False`` refuses to) and trains across the ranks: each rank its own
    micro-batches, gradients averaged, ZeRO stages 1 and 2 sharding the optimizer states (CPU
    tensors; stage 3, fp16 and GPUs across ranks are refused, not built yet). The loop is
    DeepSpeed's::

        engine, opt, _, _ = strata.torch.initialize(model=model, config="ds_config.json")
        for batch in loader:
            loss = engine(batch)
            engine.backward(loss)   # divides by gradient_accumulation_steps, as DeepSpeed
            engine.step()           # steps at the end of each accumulation window
    """
    # deepspeed.initialize's other arguments: accepted when they ask for nothing.
    unsupported = {k: v for k, v in unsupported.items() if v is not None}
    if unsupported:
        raise TypeError(f"initialize() does not take {sorted(unsupported)} (deepspeed's "
                        "mpu, collate_fn, mesh_param, ... are not used by Strata)")
    if model is None:
        raise ValueError("initialize() needs model=")
    if training_data is not None:
        raise NotImplementedError(
            "initialize(training_data=...) is not built: build a torch DataLoader with "
            "batch_size=engine.train_micro_batch_size_per_gpu() yourself")
    if config is not None and config_params is not None:
        raise ValueError("give config or config_params, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepspeed", None)
    if config is not None and isinstance(from_args, (str, os.PathLike, dict)):
        raise ValueError("a config was given both as config= and in args (deepspeed_config or "
                         "the HF Trainer's deepspeed): give one (DeepSpeed refuses both too)")
    if config is None:
        config = from_args
    if config is None:
        raise ValueError("initialize() needs config= (a DeepSpeed config file or dict)")
    if optimizer is not None and (isinstance(optimizer, torch.optim.Optimizer)
                                  or not callable(optimizer)):
        raise TypeError("optimizer= must be a callable taking the parameters (the optimizer "
                        "is built after the parameters are offloaded)")
    place = _ranks.join(dist_init_required)

    def read() -> tuple[dict, dict]:
        # Everything that can refuse the config, on every rank before the model changes:
        # across ranks, read_config_alike tells every rank of one that refused.
        loaded, document = load_config(config, args, place.world_size)
        _check_config(loaded, document, place, client_optimizer=optimizer is not None,
                      lr_scheduler=lr_scheduler)
        return loaded, document

    loaded, document = _ranks.read_config_alike(place, read, model)
    _report(loaded)
    options = json.loads(loaded["options"])
    stage = options["placement"]["zero_stage"]

    # What DeepSpeed does to the model: onto the process's GPU if there is one, in the
    # config's dtype.
    device = _ranks.device_of(model)
    model.to(device, _DTYPES[options["precision"]["working_dtype"]])
    placement = options["placement"]
    nvme = options["nvme"]
    if placement["params"] != "device":
        param_path = _nvme_path(document, "offload_param", nvme["paths"])
        offload_parameters(model, _PARAM_TIERS[placement["params"]], nvme_path=param_path)
    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    forward = _ranks.wrap(model, place)
    settings = _offload_options(options, document, device)
    if forward is not model:
        # DDP averages the gradients after backward: the engine takes them at step(), since
        # what it would take during backward is each rank's own and every update would be
        # redone.
        settings["overlap"] = False
        settings["shard_states"] = _ranks.shards_states(place, stage)
    if optimizer is None:
        optimizer = _build_optimizer(options, params, settings)
    else:
        optimizer = _client_optimizer(optimizer, params, settings)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    engine = ModelEngine(model, optimizer, lr_scheduler,
                         options["optimizer"]["gradient_accumulation_steps"],
                         loaded["micro_batch_size"], loaded["train_batch_size"], device,
                         place=place, forward=forward)
    return engine, optimizer, None, lr_scheduler


def _check_config(loaded: dict, document: dict, place: _ranks.Place, *, client_optimizer: bool,
                  lr_scheduler: Any) -> None:
    """What initialize refuses in a config the engine's parser accepted, NVMe paths that are
    not directories among it (each rank checks its own node's)."""
    options = json.loads(loaded["options"])
    _ranks.refuse_unbuilt(place, options["placement"]["zero_stage"],
                       options["precision"]["working_dtype"])
    if "scheduler" in document and lr_scheduler is None:
        raise NotImplementedError(
            "the config's \"scheduler\" section is not built into Strata: build the schedule "
            "with torch.optim.lr_scheduler and pass initialize(lr_scheduler=...)")
    if not client_optimizer and not loaded["has_optimizer"]:
        raise ValueError("the config has no \"optimizer\" section: add one, or pass "
                         "optimizer= (a callable taking the parameters)")
    if client_optimizer and loaded["has_optimizer"]:
        raise ValueError("the config has an \"optimizer\" section and optimizer= was given: "
                         "use one (DeepSpeed refuses both too)")
    placement, paths = options["placement"], options["nvme"]["paths"]
    for section, tier in (("offload_param", placement["params"]),
                          ("offload_optimizer", placement["optimizer_states"])):
        if tier == "nvme":
            nvme_directory(_nvme_path(document, section, paths))


def _report(loaded: dict) -> None:
    """What `strata config check` says besides the options: the DeepSpeed keys Strata does not
    use (a warning: activation_checkpointing, say, does nothing here) and the "auto" values
    resolved (logged)."""
    if loaded["ignored_keys"]:
        warnings.warn("DeepSpeed config keys not used by Strata (ignored): "
                      + ", ".join(loaded["ignored_keys"]), _log.StrataWarning, stacklevel=3)
    for note in loaded["auto_resolved"]:
        _log.logger.info(note)


def _client_optimizer(build: Callable[..., Any], params: list, settings: dict) -> Any:
    """optimizer=: called with the parameters and the config's settings as keywords (clipping,
    accumulation, where the states live, fp16's scaler), which DeepSpeed applies to a client
    optimizer too."""
    try:
        inspect.signature(build).bind(params, **settings)
    except TypeError:
        raise TypeError(
            "optimizer= is called with the parameters and the config's settings as keywords "
            f"({', '.join(settings)}), which it passes on: write it as "
            "lambda params, **settings: st.OffloadLion(params, lr=1e-4, **settings)") from None
    except ValueError:  # No signature to check (a builtin): call it and see.
        pass
    optimizer = build(params, **settings)
    if not isinstance(optimizer, OffloadOptimizer):
        raise TypeError(f"optimizer= returned a {type(optimizer).__name__}; it must build a "
                        "strata optimizer (OffloadAdamW, OffloadAdam, OffloadAdagrad, "
                        "OffloadLion)")
    return optimizer


def _nvme_path(document: dict, section: str, paths: list[str]) -> str | None:
    """The nvme_path of zero_optimization.`section`, or the engine's first path."""
    zero = document.get("zero_optimization", {})
    path = zero.get(section, {}).get("nvme_path")
    return path if path is not None else (paths[0] if paths else None)


def _offload_options(options: dict, document: dict, device: torch.device) -> dict:
    """The optimizer's offload keywords and config fragment for the config's settings."""
    placement, host, nvme = options["placement"], options["host"], options["nvme"]
    precision, optimizer = options["precision"], options["optimizer"]
    states = placement["optimizer_states"]
    fragment: dict[str, Any] = {"placement": {"max_params_in_host": placement["max_params_in_host"]}}
    if nvme["paths"]:
        fragment["nvme"] = {k: nvme[k] for k in ("paths", "block_size", "queue_depth",
                                                  "thread_count", "single_submit",
                                                  "overlap_events")}
        fragment["host"] = {k: host[k] for k in ("optimizer_buffer_count",
                                                  "param_buffer_count")}
    if device.type == "cuda":
        fragment.setdefault("host", {})["pin_memory"] = host["pin_memory"]
    if precision["working_dtype"] == "fp16":
        fragment["precision"] = {k: precision[k] for k in ("initial_scale_power",
                                                           "loss_scale_window", "hysteresis",
                                                           "min_loss_scale")}
    if not optimizer.get("bias_correction", True):
        fragment["optimizer"] = {"bias_correction": False}
    return {
        "offload": _STATE_TIERS[states],
        "nvme_path": _nvme_path(document, "offload_optimizer", nvme["paths"])
        if states == "nvme" else None,
        "offload_ratio": placement["offload_ratio"],
        "max_grad_norm": optimizer["gradient_clipping"],
        "gradient_accumulation_steps": optimizer["gradient_accumulation_steps"],
        "loss_scale": ("dynamic" if precision["loss_scale"] == 0.0
                       else precision["loss_scale"]),
        "config": fragment,
    }


def _build_optimizer(options: dict, params: list, offload: dict) -> Any:
    o = options["optimizer"]
    kind = _OPTIMIZERS[o["type"]]
    hyper: dict[str, Any] = {"lr": o["lr"], "weight_decay": o["weight_decay"]}
    if kind is not rules.OffloadAdagrad:
        hyper["betas"] = (o["beta1"], o["beta2"])
    if kind is not rules.OffloadLion:
        hyper["eps"] = o["eps"]
    return kind(params, **hyper, **offload)


class ModelEngine(torch.nn.Module):
    """What ``initialize`` returns first: the model, with DeepSpeed's engine calls. Calling it
    runs the model; ``backward(loss)`` and ``step()`` are called every micro-batch, and the
    optimizer steps (and the scheduler with it) at the end of each accumulation window."""

    def __init__(self, module: torch.nn.Module, optimizer: Any, lr_scheduler: Any,
                 gradient_accumulation_steps: int, micro_batch_size: int | None,
                 train_batch_size: int | None, device: torch.device, *,
                 place: _ranks.Place, forward: torch.nn.Module) -> None:
        super().__init__()
        self.module = module
        # DDP's wrapper across ranks (not a submodule: the engine's state_dict is the model's).
        object.__setattr__(self, "_forward_module", forward)
        self.device = device
        self.global_rank = place.global_rank
        self.local_rank = place.local_rank
        self.world_size = place.world_size
        self.skipped_steps = 0
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self._accumulation = gradient_accumulation_steps
        self._micro_batch_size = micro_batch_size
        self._train_batch_size = train_batch_size
        self.micro_steps = 0
        self.global_steps = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._forward_module is not self.module:
            # DDP reduces at the accumulation window's end only, as DeepSpeed does: the
            # micro-steps before sum their gradients locally (what DDP's no_sync() does; the
            # choice is DDP's at each forward).
            self._forward_module.require_backward_grad_sync = \
                self.is_gradient_accumulation_boundary()
        return self._forward_module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """loss.backward(), divided by the accumulation steps (DeepSpeed's scale_wrt_gas) and
        multiplied by the fp16 loss scale. Returns the loss divided, as DeepSpeed does."""
        scaled = loss / self._accumulation if scale_wrt_gas and self._accumulation > 1 else loss
        self.optimizer.scale(scaled).backward(retain_graph=retain_graph)
        return scaled

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self._accumulation == 0

    def step(self, lr_kwargs: dict | None = None) -> None:
        """At the end of an accumulation window: the optimizer's step, the scheduler's (not
        after a step fp16 skipped for overflow, as DeepSpeed, so a warmup is not used up by
        them; lr_kwargs go to it), and zero_grad. Otherwise it only counts the micro-step."""
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            if self.optimizer.last_step["skipped"]:
                self.skipped_steps += 1
            elif self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.optimizer.zero_grad()
            self.global_steps += 1
        self.micro_steps += 1

    def gradient_accumulation_steps(self) -> int:
        return self._accumulation

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self._micro_batch_size

    def train_batch_size(self) -> int | None:
        return self._train_batch_size

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm (before clipping), as DeepSpeed reports it."""
        report = self.optimizer.last_step
        norm = None if report is None else report["grad_norm"]
        return None if norm is None or math.isnan(norm) else norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "ModelEngine.save_checkpoint is not built: save {'model': "
            "engine.module.state_dict(), 'optimizer': optimizer.state_dict()} with torch.save "
            "(model.state_dict() gathers offloaded parameters), and load both back")

    load_checkpoint = save_checkpoint
