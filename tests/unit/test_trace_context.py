"""The W3C trace context BlockFlow reads from clients and writes into data headers
(blockflow/core/tracing.py)."""
from blockflow.core.tracing import parse_traceparent, traceparent

CLIENT_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN = 0x00F067AA0BA902B7


def test_traceparent_is_read_as_the_w3c_format_says():
    good = traceparent(CLIENT_TRACE, CLIENT_SPAN)
    assert good == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(good) == (CLIENT_TRACE, CLIENT_SPAN, True)
    assert parse_traceparent(traceparent(CLIENT_TRACE, CLIENT_SPAN, sampled=False))[2] is False
    for bad in (None, 7, "", good.upper(), good[:-1], "01" + good[2:], good.replace("4bf9", "xyz9"),
                traceparent(0, CLIENT_SPAN), traceparent(CLIENT_TRACE, 0), good + " "):
        assert parse_traceparent(bad) is None, bad
