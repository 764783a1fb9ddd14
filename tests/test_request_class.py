"""The request class carried in W3C tracestate (front writes, server reads)."""

from lineside.request_class import read_member, tracestate_member, with_member


def test_member_round_trip_and_placement():
    m = tracestate_member(priority="high", mode="batch")
    assert m == "lineside=priority:high;mode:batch"
    assert read_member(m) == {"priority": "high", "mode": "batch"}
    assert tracestate_member(priority=None, mode="realtime") == "lineside=mode:realtime"
    assert tracestate_member(priority=None, mode=None) is None
    # ours goes first; a client's own lineside member is dropped, other vendors' kept in order
    assert with_member("rojo=00f0, lineside=priority:high, congo=t61", "lineside=priority:low") == (
        "lineside=priority:low,rojo=00f0,congo=t61")
    assert with_member("lineside=priority:high", None) is None
    assert with_member(None, None) is None
    assert read_member("rojo=1,congo=2") == {} and read_member(None) == {}
    assert read_member("lineside=priority:;mode:batch;x:y") == {"mode": "batch"}
