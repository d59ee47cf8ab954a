"""Fixtures of the cost-model tests: the H200 calibration files (tests/data/calibration, copied from
../shared/calibration; a shared folder beside the checkout is the fallback)."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = (ROOT / "tests" / "data" / "calibration", ROOT / "shared" / "calibration",
              ROOT.parent / "shared" / "calibration")


@pytest.fixture(scope="session")
def calibration() -> dict:
    """{'grid': h200_gemm_grid.json, 'probe': h200_1gpu_probe.json}; skips if the folder is absent."""
    for d in CANDIDATES:
        if (d / "h200_gemm_grid.json").is_file() and (d / "h200_1gpu_probe.json").is_file():
            return {"grid": json.loads((d / "h200_gemm_grid.json").read_text()),
                    "probe": json.loads((d / "h200_1gpu_probe.json").read_text())}
    pytest.skip(f"calibration folder absent (looked in {', '.join(map(str, CANDIDATES))}): "
                "held-out H200 checks need h200_gemm_grid.json and h200_1gpu_probe.json")
