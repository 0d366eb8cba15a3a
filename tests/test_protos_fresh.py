"""Generated gRPC code matches protos/: fails when someone edits a .proto and forgets to regen."""

from __future__ import annotations

import subprocess

from tests.conftest import REPO


def test_generated_code_is_fresh(tmp_path):
    subprocess.run([str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*"))
    assert fresh, "protoc produced nothing"
    committed = sorted(
        p.relative_to(REPO) for d in ("rpc", "v1") for p in (REPO / "megaserve" / d).glob("*_pb2*")
    )
    assert fresh == committed, "run scripts/gen_protos.sh (make protos)"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (REPO / rel).read_bytes(), f"{rel} is stale"
