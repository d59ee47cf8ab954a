import warnings

import pytest
import torch

from overlapkit.runtime import comm, state
from overlapkit.cli import main
from overlapkit.doctor import advice, facts


def test_facts_on_this_machine():
    info = facts()
    assert info["torch"] == torch.__version__
    assert info["backends"]["gloo"] is True
    assert info["cuda_available"] == torch.cuda.is_available()
    assert len(info["gpus"]) == torch.cuda.device_count()


@pytest.mark.parametrize("value,needle", [(None, "may start out of issue order"),
                                          ("1", "start in the order they were issued"),
                                          ("8", "8 hardware queues")])
def test_max_connections_advice(monkeypatch, value, needle):
    info = facts()
    info["env"]["CUDA_DEVICE_MAX_CONNECTIONS"] = value
    lines = advice(info)
    assert needle in lines[0]
    assert any("Tensor-parallel overlap" in line and "wants 1" in line for line in lines)
    assert any("FSDP" in line and "unset or > 1" in line for line in lines)


@pytest.mark.parametrize("version,warned", [("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False),
                                             ("2.14.1", False)])
def test_single_tensor_optimizer_advice_before_torch_2_13(version, warned):
    info = facts()
    info["torch"] = version
    assert any("single-tensor path over DTensor parameters" in line and "foreach=True" in line
               for line in advice(info)) is warned


def test_bulk_warning_only_on_cuda_without_one(monkeypatch):
    state.reset()  # the once-per-process advice is kept in the registry
    assert comm.warn_if_max_connections_unsuited("cpu") is False
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert comm.warn_if_max_connections_unsuited("cuda") is False
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert comm.warn_if_max_connections_unsuited("cuda") is True
        assert comm.warn_if_max_connections_unsuited("cuda") is False  # once per process
    assert len(caught) == 1 and "CUDA_DEVICE_MAX_CONNECTIONS=8" in str(caught[0].message)


def test_doctor_cli_json(capsys):
    assert main(["doctor", "--json"]) == 0
    assert '"torch"' in capsys.readouterr().out
