"""The stall watchdog: a span older than stall_s is not alive, one older than exit_s calls
on_stuck; the flags' pairs a worker refuses, by name, before it loads a model."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from megaserve.watchdog import StallConfig, StallConfigError, StallWatch
from tests.polling import until


def test_a_span_past_stall_s_is_not_alive_and_past_exit_s_is_stuck():
    watch = StallWatch(StallConfig(stall_s=0.2, exit_s=0.5), "test step", poll_s=0.02)
    stuck: list[str] = []
    watch.start(stuck.append)
    with watch.span():  # a short step: alive throughout
        assert watch.alive() and watch.stalled_for() < 0.2
    assert watch.alive() and watch.stalled_for() == 0.0
    release = threading.Event()

    def step():
        with watch.span():
            release.wait()

    t = threading.Thread(target=step)
    t.start()
    t0 = time.monotonic()
    until(lambda: not watch.alive(), "stall")
    assert time.monotonic() - t0 >= 0.2
    until(lambda: stuck, "on_stuck")
    assert time.monotonic() - t0 >= 0.5
    assert stuck[0].startswith("test step running for") and "limit 0.5 s" in stuck[0]
    release.set()
    t.join()
    assert watch.alive() and watch.stalls == 1
    watch.stop()


def test_limits_off():
    watch = StallWatch(StallConfig(stall_s=0, exit_s=0)).start(lambda why: None)
    assert watch._thread is None  # nothing to watch
    with watch.span():
        time.sleep(0.05)
        assert watch.alive() and watch.stalled_for() > 0


@pytest.mark.parametrize(
    ("stall", "exit_", "message"),
    [
        (-1, 300, "--stall-s -1 and --stall-exit-s 300 must be >= 0"),
        (60, 30, "--stall-exit-s 30 must be 0 .never. or at least --stall-s 60"),
    ],
)
def test_bad_pairs_are_refused_by_name(stall, exit_, message):
    with pytest.raises(StallConfigError, match=message):
        StallConfig(stall, exit_)
    assert StallConfig(60, 0) and StallConfig(0, 30)  # either may be off


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_flags(role):
    if role == "decode":
        from decode_service.config import add_arguments, config_from_args
    else:
        from prefill_service.config import add_arguments, config_from_args
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--stall-s", "5", "--stall-exit-s", "0"]))
    assert cfg.stall == StallConfig(5.0, 0.0)
    assert config_from_args(p.parse_args([])).stall == StallConfig()
    with pytest.raises(StallConfigError, match="--stall-exit-s 2.0 must be 0"):
        config_from_args(p.parse_args(["--stall-s", "5", "--stall-exit-s", "2"]))
