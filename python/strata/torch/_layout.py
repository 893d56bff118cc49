"""The protocol every parameter layout implements: how an optimizer's parameters sit beside the
engine's chunks, how their gradients reach it, and how their states read and write.

The step body (_step.py) is the same for every layout; what differs is a Layout:

- ``Resident`` (_resident.py): the parameters' memory is the engine's chunks (``.data`` views
  them); gradient hooks count backward passes and hand each chunk over once its gradients are
  complete.
- ``Fsdp2Shards`` and ``StateShards`` (_mirrored.py): the engine holds a part of each parameter
  (FSDP2's shard, a 1/N slice) and mirrors it: copied in with its gradient, copied back after
  the step.
- ``Offloaded`` (_offloaded.py): ``offload_parameters``: the parameters live off the device
  between uses, and module hooks put them there while their modules run.

_layouts.py picks one for a parameter list; adding a layout is a new file implementing this
class and a line there. A layout is built before the engine (its parts decide what is
registered), then attached to the engine and the step body; it holds neither the optimizer nor
anything that holds it, so that the optimizer can be collected while hooks remain; what it
refers back to (the step body) it holds weakly, so that no part of an optimizer is in a cycle
and its engine (with its NVMe files) goes with its last reference, even at exit.

Parts: ``local(i, t)`` is the part of parameter i (or of its gradient) this rank's engine holds;
the base class is the identity (whole parameters), which mirrored layouts override.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch

from strata.torch._dtensor import is_dtensor
from strata.torch._native import MASTER, NativeEngine
from strata.torch._params import ParamTable, flat_fp32

if TYPE_CHECKING:
    from strata.torch._step import StepBody
    from strata.torch._step_state import StepState


@dataclasses.dataclass
class Prepared:
    """What a layout's prepare_step found: whether there is a step to take (False: every
    gradient was dropped after backward, and torch would skip every parameter), and an error
    to raise once the step is done (the gradients changed after the engine took them)."""

    proceed: bool = True
    deferred_error: str | None = None


class Layout:
    """The base: whole parameters, and what every layout shares (state I/O through the
    engine). Subclasses implement the hooks' side."""

    # The engine reads the gradients again at step() and redoes what changed
    # (optimizer.recheck_gradients): what the trainer does between backward and step() is seen.
    rechecks = False
    # The engine's own gradient clipping applies (False: the layout clips on the whole norm).
    engine_clips = True
    # HostDevice memory is sized to the chunks (False: the plan's device_memory sizes it).
    fits_host_device = True
    # state_dict() needs consolidate_state_dict() first: no rank holds whole states.
    consolidates = False

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._params = params
        self.native: NativeEngine | None = None
        self.table: ParamTable | None = None

    # ------------------------------------------------------------------- construction

    def configure(self, options: dict[str, Any]) -> None:
        """Adds what this layout needs to the engine's config (engine_options' dict)."""

    def attach(self, native: NativeEngine, table: ParamTable, body: StepBody) -> list[Any]:
        """The engine exists and has laid the parameters out: views, hooks. Returns what the
        optimizer's finalizer calls (a function and its arguments, none of which may hold the
        optimizer) to give the parameters memory of their own and remove the hooks."""
        self.native, self.table = native, table
        return []

    # ------------------------------------------------------------------ the step's life

    def begin_step(self, state: StepState) -> None:
        """At a step's first gradient: torch-side changes reach the engine."""

    def prepare_step(self, state: StepState) -> Prepared:
        """step(), before the engine's: every chunk with gradients goes to the engine. Raises
        when the step cannot be taken (no backward since the last step)."""
        raise NotImplementedError

    def step_completed(self, state: StepState) -> None:
        """The engine completed the step `state` describes (before the state is reset)."""

    def finish_step(self, report: dict[str, Any], grad_norm: float | None) -> None:
        """After a completed step: the parameters see the update; `report` gets what the
        layout measured itself."""

    def zero_grad(self, state: StepState) -> bool:
        """zero_grad(): refuses or discards what the open step has; whether torch's
        zero_grad should follow."""
        raise NotImplementedError

    # Whether chunks already handed over can be taken back (the engine drops the step): only
    # where the engine rechecks the gradients, i.e. can redo what it did ahead.
    @property
    def takes_back(self) -> bool:
        return self.rechecks

    def interrupted(self) -> None:
        """Outside forward and backward: lets go of what a pass that raised still holds."""

    def metrics(self, out: dict[str, Any]) -> None:
        """Adds the layout's own figures to opt.metrics()."""

    # ---------------------------------------------------------------------------- parts

    def local(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """The part of parameter i (or of its gradient, `t`) this rank holds: a view."""
        return t

    def engine_shape(self, i: int) -> list[int]:
        """The shape the engine registers for parameter i's part: one element stands for an
        empty part (and for a 0-dimensional parameter)."""
        shape = list(self.local(i, self._params[i]).shape)
        return shape if shape and math.prod(shape) > 0 else [1]

    def registered_values(self, i: int) -> torch.Tensor:
        """Parameter i's part as the engine registers it (flat fp32)."""
        return flat_fp32(self.local(i, self._params[i]))

    def state_numel(self, i: int) -> int:
        """Elements of a state local_state takes for parameter i."""
        return self._params[i].numel()

    def states(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        """States read from the engine (flat, the engine's numel) as this rank holds them,
        without a collective: shaped as their parameter (as its part, where it has one)."""
        return [self._shaped(i, v) for i, v in zip(indices, values)]

    def whole_states(self, indices: list[int], values: list[torch.Tensor]) -> list[torch.Tensor]:
        """States whole on this rank (a collective where parts are spread over ranks)."""
        return self.states(indices, values)

    def local_state(self, i: int, values: Any, engine_numel: int) -> torch.Tensor:
        """A state given for parameter i (whole, or a DTensor of any sharding) as the flat fp32
        host tensor the engine takes for this rank's part. Raises ValueError naming the sizes
        when it fits neither."""
        tensor = torch.as_tensor(values).detach()
        if is_dtensor(tensor):
            tensor = self._local_of_dtensor(i, tensor)
        tensor = tensor.to("cpu", torch.float32).reshape(-1).contiguous()
        expected = self.state_numel(i)
        if tensor.numel() != expected:
            raise ValueError(f"has {tensor.numel()} elements; {self._whose()} has {expected}")
        tensor = self._local_of_whole(i, tensor)
        if tensor.numel() < engine_numel:  # An empty part's stand-in.
            tensor = torch.zeros(engine_numel)
        return tensor

    def _shaped(self, i: int, values: torch.Tensor) -> torch.Tensor:
        mine = self.local(i, self._params[i])
        return values[: mine.numel()].view(mine.shape)

    def _local_of_dtensor(self, i: int, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.full_tensor()

    def _local_of_whole(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        return flat

    def _whose(self) -> str:
        return "the parameter"

    # ------------------------------------------------------------------- states, between steps

    def read_states(self, wanted: list[tuple[int, int]]) -> list[torch.Tensor]:
        """States (parameter index, kind) as flat fp32 tensors, in one engine call."""
        records = self.table.records
        return self.native.read_states([(i, kind, records[i].numel) for i, kind in wanted])

    def state_batch(self, writes: list[tuple[int, int, Any, str]]) -> list[tuple]:
        """The engine's batch for `writes` ((parameter index, kind, values, what they are)),
        every size checked (ValueError naming the parameter)."""
        batch = []
        for i, kind, values, what in writes:
            try:
                tensor = self.local_state(i, values, self.table.records[i].numel)
            except ValueError as e:
                raise ValueError(f"{what} of parameter {i} {e}") from None
            batch.append((i, kind, tensor))
        return batch

    def write_state_batch(self, batch: list[tuple]) -> None:
        self.native.write_states(batch)
        if any(kind == MASTER for _, kind, _ in batch):
            self.masters_written()

    def write_states(self, writes: list[tuple[int, int, Any, str]]) -> None:
        self.write_state_batch(self.state_batch(writes))

    def masters_written(self) -> None:
        """Masters were written: the chunks' working values changed (mirrored layouts copy
        them into the parameters' parts)."""

    def adopt_parameter_changes(self, everything: bool = False) -> None:
        """Parameters written in place since the engine last set them become their masters
        (every parameter with `everything`)."""

    def mark_versions(self) -> None:
        """The parameters' current values are the engine's (after a load)."""
