"""Loaded by every Python process whose path holds this folder (``benchmarks/attribution.py`` puts it there):
in a delivery agent, and only when ``RLLOG_BENCH_AGENT_PROBE`` names a folder, it installs the CPU ledger of
``benchmarks/agent_probe.py``. Any other process is left alone."""

import os

if os.environ.get("RLLOG_BENCH_AGENT_PROBE"):
    try:
        with open("/proc/self/cmdline", "rb") as _cmdline:
            _argv = _cmdline.read().split(b"\0")
    except OSError:
        _argv = []
    if any(b"rllog.agent" in _arg for _arg in _argv):
        import agent_probe

        agent_probe.install(os.environ["RLLOG_BENCH_AGENT_PROBE"])
