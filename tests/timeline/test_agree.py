"""Pairing a recorder's spans with a trace's: constructed cases with known pairings."""

import pytest

from overlapkit.timeline import Span
from overlapkit.timeline.agree import compare_spans, estimate_offset


def rec(kind, a, b, name="x"):
    return Span(kind, name, "comm" if kind != "compute" else "compute", a, b)


def test_overlapping_transfers_of_one_kind_pair_in_issue_order():
    # bucket 1 is issued while bucket 0 runs; each traced transfer starts after its own issue
    recorded = [rec("dp_all_reduce", 0, 10, "b0"), rec("dp_all_reduce", 5, 14, "b1")]
    traced = [rec("dp_all_reduce", 1, 10, "gloo:all_reduce"), rec("dp_all_reduce", 9.5, 13, "gloo:all_reduce")]
    a = compare_spans(recorded, traced, offset_ms=0.0)
    assert a.ok(0.1) and a.matched == 2 and a.late_comm_ms == 0
    # a greedy pairing would give both to b0; issue order gives the second to b1
    late = compare_spans(recorded, [traced[0], rec("dp_all_reduce", 9.5, 15, "g")], offset_ms=0.0)
    assert late.late_comm_ms == pytest.approx(1.0) and not late.ok(0.5) and late.ok(0.5, comm_end_tol_ms=2.0)


def test_an_exchange_and_a_gemm_may_hold_several_traced_spans():
    recorded = [rec("tp_all_gather", 0, 10), rec("compute", 1, 9, "fc1"), rec("compute", 9.2, 12, "fc1")]
    traced = [rec("tp_all_gather", 0.5, 9, "send"), rec("tp_all_gather", 0.6, 9.5, "recv"),
              rec("compute", 1.01, 4, "fc1"), rec("compute", 4, 8.99, "fc1"), rec("compute", 9.22, 11.98, "fc1")]
    a = compare_spans(recorded, traced, offset_ms=0.0, tol_ms=0.05)
    assert a.ok(0.05) and a.matched == 3


def test_a_computation_traced_shorter_than_its_record_disagrees():
    # the profiler range inside its record, but 1 ms of the recorded time is not in it
    a = compare_spans([rec("compute", 0, 5, "fc1")], [rec("compute", 0.01, 3.99, "fc1")], offset_ms=0.0)
    assert a.matched == 1 and a.early_ms == 0 and a.late_compute_ms == 0
    assert a.compute_diff_ms == pytest.approx(1.02) and not a.ok(0.5) and a.ok(1.1)
    assert a.worst_compute == "fc1@0.000: recorded 5.000 ms, traced 3.980 ms"


def test_a_pipeline_receive_pairs_by_its_end_and_a_bubble_with_no_compute():
    # receives posted at 0 and 1; the recorder starts each at its peer's send (3 and 6), the
    # wait before that is bubble; the profiler's receive ranges open at the post
    recorded = [rec("pp_bubble", 2, 3, "wait"), rec("pp_recv", 3, 4), rec("compute", 4, 5, "F"),
                rec("pp_bubble", 5, 6, "wait"), rec("pp_recv", 6, 7)]
    traced = [rec("pp_recv", 0, 4), rec("pp_recv", 1, 7), rec("compute", 4, 5, "F")]
    a = compare_spans(recorded, traced, offset_ms=0.0, tol_ms=0.05)
    assert a.ok(0.05) and a.matched == 5 and not a.missing
    busy = compare_spans(recorded, [*traced, rec("compute", 5.2, 5.6, "F")], offset_ms=0.0, tol_ms=0.05)
    assert busy.missing == ["pp_bubble:wait@5.000 (computing 0.400 ms of it)"]


def test_missing_unmatched_and_sticking_out_are_reported():
    recorded = [rec("compute", 0, 5, "fc1"), rec("dp_all_reduce", 0, 5)]
    traced = [rec("compute", 1, 7, "fc1"), rec("tp_all_gather", 1, 2), rec("compute", 1, 2, "other_kernel")]
    a = compare_spans(recorded, traced, offset_ms=0.0)
    assert a.missing == ["dp_all_reduce:x@0.000"]
    assert a.unmatched == ["tp_all_gather:x@1.000"]  # ours by kind, but nothing recorded it
    assert a.late_compute_ms == 2 and not a.ok(0.5)  # 'other_kernel' is not ours: ignored


def test_offset_from_the_first_of_each_computation():
    recorded = [rec("compute", 0, 5, "a"), rec("compute", 6, 9, "b"), rec("compute", 10, 12, "a")]
    traced = [s.shifted(-100.0) for s in recorded]  # the trace's clock runs 100 ms ahead
    assert estimate_offset(recorded, traced) == 100.0
    assert compare_spans(recorded, traced).ok(1e-9)
    with pytest.raises(ValueError, match="no computation appears in both"):
        estimate_offset(recorded, [])


def test_a_transfer_still_in_flight_when_the_window_ended_is_cut_not_missing():
    # ZeRO's gather for the next step, issued 0.1 ms before the profiler stopped (trace time 20 = recorder
    # time 10 at an offset of 10): recorded issue to completion, never in the trace
    recorded = [rec("compute", 0, 9.8, "fwd"), rec("zero_all_gather", 9.9, 19.0, "bucket0")]
    traced = [rec("compute", 10.01, 19.79, "fwd")]
    a = compare_spans(recorded, traced, offset_ms=10.0, window_end_ms=20.0)
    assert a.ok(0.05) and a.cut == ["zero_all_gather:bucket0@9.900"] and not a.missing and a.matched == 1
    # a transfer that ended inside the window and is not traced is still missing
    inside = compare_spans([*recorded[:1], rec("zero_all_gather", 9.0, 9.5, "bucket0")], traced, offset_ms=10.0,
                           window_end_ms=20.0)
    assert inside.missing == ["zero_all_gather:bucket0@9.000"] and not inside.cut
    # without the window's end nothing is set apart
    assert compare_spans(recorded, traced, offset_ms=10.0).missing == ["zero_all_gather:bucket0@9.900"]
