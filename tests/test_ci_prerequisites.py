"""A missing prerequisite (the transformers reference env, libtpu) skips a test on a developer
machine and fails it under CI=true, so CI cannot go green without those tests running."""

from __future__ import annotations

import pytest

from tests import conftest


@pytest.mark.parametrize("value", ["", "false", "0"])
def test_missing_prerequisite_skips_outside_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match="no widget"):
        conftest.require(False, "no widget")
    conftest.require(True, "no widget")  # present: nothing happens


@pytest.mark.parametrize("value", ["true", "TRUE", "1"])
def test_missing_prerequisite_fails_under_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="no widget.*CI=true"):
        conftest.require(False, "no widget")
    conftest.require(True, "no widget")


def test_ref_env_and_libtpu_checks_use_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(conftest, "REF_PYTHON", tmp_path / ".venv-ref" / "bin" / "python")
    with pytest.raises(pytest.fail.Exception, match=r"\.venv-ref"):
        conftest.require_ref_env()
    monkeypatch.setattr(conftest.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(pytest.fail.Exception, match="libtpu"):
        conftest.require_libtpu()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="libtpu"):
        conftest.require_libtpu()


class _Item:
    def __init__(self, *markers):
        self.markers = markers

    def get_closest_marker(self, name):
        return name if name in self.markers else None


def test_markers_alone_require_their_prerequisite(monkeypatch, tmp_path):
    """conftest's setup hook: a test marked `reference` needs .venv-ref, one marked
    `tpu_compile` needs libtpu, whatever the test itself checks."""
    monkeypatch.setattr(conftest, "REF_PYTHON", tmp_path / "no-python")
    monkeypatch.setattr(conftest.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("CI", "true")
    conftest.pytest_runtest_setup(_Item())  # unmarked: nothing required
    with pytest.raises(pytest.fail.Exception, match="make ref-env"):
        conftest.pytest_runtest_setup(_Item("reference"))
    with pytest.raises(pytest.fail.Exception, match="libtpu"):
        conftest.pytest_runtest_setup(_Item("tpu_compile"))
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception):
        conftest.pytest_runtest_setup(_Item("reference"))
