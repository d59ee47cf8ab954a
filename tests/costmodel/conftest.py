"""Fixtures of the cost-model tests: the H200 calibration files (tests/data/calibration, copied from
../shared/calibration; a shared folder beside the checkout is the fallback), and the benchmark scripts
that set the model beside published and measured steps, loaded as modules."""

import importlib.util
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


def benchmark_script(name: str):
    """benchmarks/NAME.py loaded as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def bench():
    """benchmarks/model_vs_measured.py as a module."""
    return benchmark_script("model_vs_measured")


@pytest.fixture(scope="session")
def mvp():
    """benchmarks/model_vs_published.py as a module."""
    return benchmark_script("model_vs_published")


@pytest.fixture(scope="session")
def cpu16():
    """benchmarks/_lib/ep_cp_vs_measured.py (model_vs_measured.py --ep-cp) as a module."""
    return benchmark_script("_lib/ep_cp_vs_measured")
