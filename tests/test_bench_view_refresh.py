"""`megaserve bench view-refresh` on small sets: a router's view follows workers whose block
sets change at every heartbeat (real Redis, real Heartbeats), and the rows are reported."""

from __future__ import annotations

from megaserve_app.bench.view_refresh import bench_view_refresh


def test_the_view_follows_churning_block_sets():
    out = bench_view_refresh(blocks=300, workers=2, churn=7, refreshes=12)
    assert [r["blocks_replaced_per_beat"] for r in out["rows"]] == [0, 7]
    for r in out["rows"]:
        assert r["view_equals_the_sets"], r
        assert 0 < r["cpu_ms_per_refresh_median"] <= r["cpu_ms_per_refresh_mean"] * 12
