"""A real ``mlflow server`` on loopback, as a pytest fixture other test files can reuse.

Usage (``tests/`` is on ``sys.path``)::

    from mlflow_server import mlflow_server  # noqa: F401  (pytest finds the fixture by name)

    def test_something(mlflow_server):
        client = mlflow.MlflowClient(mlflow_server)   # "http://127.0.0.1:<port>"

The server uses the venv's own ``mlflow`` executable, a sqlite backend store and a local artifact root,
both under the test's ``tmp_path``; it is stopped by killing its process group (it was started in a
new session, so the uvicorn worker goes with it). Its output is in ``tmp_path/mlflow_server.log``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

START_TIMEOUT = 60.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # pgid == pid: started with start_new_session=True
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def start_mlflow_server(directory: Path) -> tuple[subprocess.Popen, str]:
    """Start ``mlflow server`` with its storage in ``directory``; return (process, uri) once healthy."""
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    mlflow_exe = Path(sys.executable).parent / "mlflow"
    cmd = [
        str(mlflow_exe), "server",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--workers", "1",
        "--backend-store-uri", f"sqlite:///{directory / 'server.db'}",
        "--default-artifact-root", str(directory / "server_artifacts"),
    ]  # fmt: skip
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true")
    log = open(directory / "mlflow_server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=directory, start_new_session=True)
    log.close()
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"mlflow server exited with {proc.returncode}: {(directory / 'mlflow_server.log').read_text()[-2000:]}"
            )
        if _healthy(uri):
            return proc, uri
        time.sleep(0.25)
    _stop(proc)
    raise RuntimeError(
        f"mlflow server not healthy after {START_TIMEOUT}s: {(directory / 'mlflow_server.log').read_text()[-2000:]}"
    )


@pytest.fixture
def mlflow_server(tmp_path):
    """A running ``mlflow server`` on 127.0.0.1 (sqlite + local artifacts under ``tmp_path/mlflow_server``).

    Yields:
        The tracking URI, ``http://127.0.0.1:<port>``.
    """
    proc, uri = start_mlflow_server(tmp_path / "mlflow_server")
    try:
        yield uri
    finally:
        _stop(proc)
