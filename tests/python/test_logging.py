"""The engine's messages reach Python's logging and warnings, never stderr directly: an
application filters them as it filters every other library's."""

import logging
import warnings

import pytest
import torch
from torch import nn

import strata
import strata.torch as st
from strata import _log


def step_with_states_on_nvme(tmp_path) -> None:
    """One step of an optimizer whose NVMe placement makes the engine say so (INFO)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = st.OffloadAdamW(model.parameters(), offload="nvme", nvme_path=tmp_path)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()


def test_engine_messages_go_to_the_strata_logger_not_stderr(tmp_path, caplog, capfd):
    with caplog.at_level(logging.INFO, logger="strata"):
        step_with_states_on_nvme(tmp_path)
    staging = [r for r in caplog.records
               if r.name == "strata" and "optimizer states on NVMe" in r.getMessage()]
    assert staging and staging[0].levelno == logging.INFO
    assert "strata: info" not in capfd.readouterr().err


def test_a_silenced_logger_silences_the_engine(tmp_path, caplog, capfd):
    with caplog.at_level(logging.WARNING, logger="strata"):
        step_with_states_on_nvme(tmp_path)
    assert not [r for r in caplog.records if r.name == "strata" and r.levelno < logging.WARNING]
    assert "strata:" not in capfd.readouterr().err


def test_engine_warnings_are_python_warnings_that_filters_reach():
    with pytest.warns(strata.StrataWarning, match="a setting changed"):
        _log.emit(2, "a setting changed")
    with warnings.catch_warnings():
        warnings.simplefilter("error", strata.StrataWarning)
        with pytest.raises(strata.StrataWarning):
            _log.emit(2, "now an error")


def test_a_handler_that_raises_does_not_fail_the_engine_call_that_carried_it(tmp_path,
                                                                               monkeypatch):
    # The engine call has already succeeded when its messages are delivered: a handler that
    # raises (warnings made errors, a broken logging handler) is reported as unraisable, and the
    # call's result stands.
    def broken(level, message):
        raise RuntimeError("handler failed on: " + message)

    unraisable = []
    monkeypatch.setattr(_log, "emit", broken)
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = st.OffloadAdamW(model.parameters(), offload="nvme", nvme_path=tmp_path)
    before = model.weight.detach().clone()
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    assert not torch.equal(before, model.weight.detach())
    assert any("optimizer states on NVMe" in str(u.exc_value) for u in unraisable)
