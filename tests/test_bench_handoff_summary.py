"""The KV hand-off rows of `megaserve bench disagg` on synthetic numbers, against hand-computed
values: the exposed tail, the hidden share measured on a raw push of the same bytes, and the
raw transfer rows against memcpy and the bare gRPC stream ceiling."""

from __future__ import annotations

import pytest

from megaserve_app.bench import summary

approx = pytest.approx


def test_exposed_tail_is_the_transfer_after_compute_ended():
    # Compute 10 ms; the first chunk leaves at 2 ms, the transfer takes 5: done at 7 ms.
    assert summary.transfer_tail_ms(2.0, 5.0, 10.0) == 0.0
    # First chunk at 6 ms, 8 ms of transfer: ends at 14, 4 ms after compute.
    assert summary.transfer_tail_ms(6.0, 8.0, 10.0) == 4.0
    # The transfer starts when compute ends: all of it shows.
    assert summary.transfer_tail_ms(10.0, 8.0, 10.0) == 8.0


def test_hidden_share_is_measured_on_a_raw_push_of_the_same_bytes():
    # Pushing the bytes alone takes 8 ms; 2 ms of it show after compute: 75% hidden.
    assert summary.hidden_fraction(2.0, 8.0) == 0.75
    assert summary.hidden_fraction(0.0, 8.0) == 1.0  # all of it behind compute
    assert summary.hidden_fraction(8.0, 8.0) == 0.0  # none of it
    # A tail longer than the raw push (a commit queued behind decode steps): nothing hidden,
    # never a negative share.
    assert summary.hidden_fraction(12.0, 8.0) == 0.0
    assert summary.hidden_fraction(0.0, 0.0) == 1.0  # no raw push time: nothing to hide
    # The old definition divided by the transfer span (first chunk .. commit), which grows
    # with the compute: a 30 s span with a 40 ms tail read 99.9% hidden. Against a 45 ms raw
    # push of the same bytes the same tail hides 11%.
    assert summary.hidden_fraction(40.0, 45.0) == approx(1 / 9)


def test_handoff_row_from_timestamps():
    row = summary.handoff_row(
        prompt_len=1024,
        bytes_sent=4_000_000,
        compute_ms=10.0,
        transfer_ms=8.0,
        first_chunk_sent_ms=6.0,
        t0=100.0,
        t1=100.002,  # Reserve answered 2 ms after it was sent
        t2=100.017,  # Prefill answered 15 ms later
        stamps=[100.020, 100.0235],  # first token at 20 ms, the second 3.5 ms after it
        raw_push_ms=5.0,  # the same 4 MB pushed alone
    )
    assert row == {
        "prompt": 1024,
        "bytes": 4_000_000,
        "reserve_ms": approx(2.0),
        "prefill_compute_ms": 10.0,
        "transfer_ms": 8.0,
        "transfer_tail_ms": 4.0,  # 6 + 8 - 10
        "raw_push_ms": 5.0,
        "hidden_fraction": approx(0.2),  # 1 - 4 / 5
        "prefill_rpc_ms": approx(15.0),
        "first_token_ms": approx(20.0),
        "first_decode_step_ms": approx(3.5),
        "transfer_GBps": 0.5,  # 4 MB in 8 ms
    }
    # A zero transfer time (nothing to send) divides by a microsecond, not by zero.
    empty = summary.handoff_row(16, 0, 1.0, 0.0, 0.0, 0, 0, 0, [0, 0], 0.0)
    assert empty["transfer_GBps"] == 0.0 and empty["hidden_fraction"] == 1.0


def test_raw_transfer_row_against_memcpy_and_the_bare_stream():
    # Three timed pushes of 2.4 GB in 0.6, 0.5 and 0.7 s: the rates are those of the median.
    row = summary.raw_transfer_row("grpc", 2_400_000_000, [0.6, 0.5, 0.7], 8.0, 5.0)
    assert row == {
        "transport": "grpc",
        "bytes": 2_400_000_000,
        "ms": approx(600.0),  # the median run
        "ms_min": approx(500.0),
        "ms_max": approx(700.0),
        "runs": 3,
        "GBps": approx(4.0),  # of the median: 2.4 GB in 0.6 s
        "memcpy_GBps": 8.0,
        "ratio": approx(0.5),
        "ceiling_GBps": 5.0,
        "of_ceiling": approx(0.8),
    }
    # Without a ceiling measured, no ceiling columns.
    assert "of_ceiling" not in summary.raw_transfer_row("grpc", 10, [1.0], 1.0)
