import pytest
import torch

from overlapkit.cli import main
from overlapkit.probe import Concurrency, hidden_fraction, verdict


def test_hidden_fraction_known_cases():
    assert hidden_fraction(5.0, 2.0, 5.0) == pytest.approx(1.0)     # the transfer vanished under the GEMM
    assert hidden_fraction(5.0, 2.0, 7.0) == pytest.approx(0.0)     # serialized
    assert hidden_fraction(5.0, 2.0, 6.0) == pytest.approx(0.5)
    assert hidden_fraction(5.0, 2.0, 9.0) == pytest.approx(-1.0)    # they slowed each other
    with pytest.raises(ValueError, match="must be > 0"):
        hidden_fraction(0.0, 2.0, 2.0)


def test_verdicts():
    assert verdict(0.95) == "overlaps" and verdict(0.5) == "partly overlaps" and verdict(-0.3) == "serialized"
    c = Concurrency("h2d", gemm_ms=5.28, transfer_ms=19.31, both_ms=19.38)  # the H200 calibration probe
    assert c.verdict == "overlaps" and c.hidden_fraction == pytest.approx(0.987, abs=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU refusal is what this checks")
def test_probe_refuses_without_cuda(capsys):
    assert main(["doctor", "--probe"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
