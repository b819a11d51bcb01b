"""Shared test set-up: every tracker offline and writing under the test's tmp dir; no network.

The network guard is an audit hook: any ``socket.connect`` to an address outside loopback fails the
test that made it (comet_ml's cloud-metadata probe included), so a test can never reach out.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rllog.offline import OFFLINE_ENV, ONLINE_VARS

ROOT = Path(__file__).resolve().parents[1]
for _k, _v in OFFLINE_ENV.items():  # before any tracker is imported by a test module
    os.environ.setdefault(_k, _v)
for _k in ONLINE_VARS:
    os.environ.pop(_k, None)
# Samples of the test process every few seconds would change the record counts tests assert on; the tests
# of system metrics turn them on explicitly (system_metrics=...).
os.environ["RLLOG_SYSTEM_METRICS"] = "0"
# init's and finish's lines on stderr would land in the output of tests that check what trackers print; the tests
# of those lines turn them on (quiet=False).
os.environ["RLLOG_QUIET"] = "1"

NETGUARD = ROOT / "tests" / "netguard"
NETGUARD_LOG = ROOT / ".pytest_netguard.log"
os.environ["RLLOG_NETGUARD_LOG"] = str(NETGUARD_LOG)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NETGUARD), str(ROOT), os.environ.get("PYTHONPATH")]))
sys.path.insert(0, str(NETGUARD))
import rllog_netguard  # noqa: E402,F401  (installs the audit hook in this process too)


@pytest.fixture
def small_disk(tmp_path):
    """A real 4 MiB filesystem (tmpfs) the test can fill and free, unmounted after. Without one (not root), the test
    skips with the reason, or fails under ``CI=true`` (``tests/sinks.py``: ``tmpfs``, ``cannot_mount``)."""
    from sinks import tmpfs

    with tmpfs(tmp_path / "disk", "size=4m") as disk:
        yield disk


@pytest.fixture(autouse=True)
def no_network():
    """Fail any test that tried (in this process or a child) to connect to a non-loopback address."""
    before = NETGUARD_LOG.read_text() if NETGUARD_LOG.exists() else ""
    yield
    after = NETGUARD_LOG.read_text() if NETGUARD_LOG.exists() else ""
    attempts = after[len(before) :]
    assert not attempts, f"test tried to reach the network: {attempts}"


@pytest.fixture(autouse=True)
def tracker_dirs(tmp_path, monkeypatch):
    """Point every tracker's storage into this test's tmp dir."""
    dirs = {
        "WANDB_DIR": tmp_path / "wandb_dir",
        "WANDB_CACHE_DIR": tmp_path / "wandb_cache",
        "WANDB_DATA_DIR": tmp_path / "wandb_data",
        "WANDB_CONFIG_DIR": tmp_path / "wandb_config",
        "TRACKIO_DIR": tmp_path / "trackio",
        "COMET_OFFLINE_DIRECTORY": tmp_path / "comet",
        "TENSORBOARD_LOGGING_DIR": tmp_path / "tensorboard",
        "RLLOG_DIR": tmp_path / "rllog_runs",
        "SWANLAB_LOG_DIR": tmp_path / "swanlab",
        "CLEARML_CACHE_DIR": tmp_path / "clearml",
    }
    for key, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(key, str(path))
    if "trackio" in sys.modules:  # trackio reads TRACKIO_DIR once, at import: repoint it
        from readers.trackio import pin_trackio_dir

        pin_trackio_dir(monkeypatch, dirs["TRACKIO_DIR"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_ARTIFACT_ROOT", str(tmp_path / "mlartifacts"))
    if "comet_ml" in sys.modules:  # only where a test already imported comet_ml
        import comet_ml.experiment

        monkeypatch.setattr(comet_ml.experiment, "get_env_cloud_details", lambda *a, **k: None)
    yield {k: str(v) for k, v in dirs.items()} | {"MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"], "tmp": str(tmp_path)}


PLUGINS = ROOT / "tests" / "plugins"


@pytest.fixture
def test_backends(monkeypatch):
    """Registers the test-only backends (jsonl, hangs, crashes, down) through a real entry point,
    in this process and in the delivery agents it starts."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PLUGINS), os.environ.get("PYTHONPATH", "")]))
    import importlib

    importlib.invalidate_caches()
    return PLUGINS
