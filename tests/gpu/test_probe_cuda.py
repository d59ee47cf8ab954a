"""The overlap probe on a real GPU: every transfer measured, and no impossible timing."""

from overlapkit.probe import measure


def test_probe_measures_both_transfers():
    rows = measure(reps=5)
    assert [r.transfer.split()[0] for r in rows] == ["host", "device"]
    for r in rows:
        assert r.gemm_ms > 0 and r.transfer_ms > 0 and r.both_ms > 0
        assert r.both_ms >= 0.9 * max(r.gemm_ms, r.transfer_ms)  # together never beats the longer one alone
