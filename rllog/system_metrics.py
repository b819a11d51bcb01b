"""System metrics of the trainer process, sampled from outside it (in the delivery agent).

:class:`SystemSampler` measures a process by pid with psutil (CPU %, resident memory, threads) and,
where NVML is installed (``pip install nvidia-ml-py``) and GPUs are present, each GPU (utilisation,
memory, power, temperature). Keys, as delivered to every tracker::

    system/cpu_percent           the trainer's CPU use (100 = one core)
    system/memory_rss_mb         the trainer's resident memory
    system/threads               the trainer's threads
    system/gpu.<i>.utilization   percent
    system/gpu.<i>.memory_used_mb
    system/gpu.<i>.memory_percent
    system/gpu.<i>.power_watts
    system/gpu.<i>.temperature_c

The agent samples every ``interval`` seconds and hands each sample to the trainer through a pipe; the
trainer's supervision thread journals it as a metrics record at the trainer's current step (the journal
has one writer), so samples are delivered, replayed and read back like any metric. Trackers' own
monitors stay off in the agent: they would measure the agent.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("rllog.system")

PREFIX = "system/"


class SystemSampler:
    """Samples process ``pid`` (and the machine's GPUs, through NVML when it is there).

    Args:
        pid: the process to measure.
        nvml: the ``pynvml`` module (default: imported if installed; None turns GPUs off).

    Example:
        >>> sampler = SystemSampler(os.getpid())
        >>> sampler.sample()["system/memory_rss_mb"] > 0
        True
    """

    def __init__(self, pid: int, nvml: Any = "import"):
        import psutil

        self.process = psutil.Process(pid)
        self.process.cpu_percent(None)  # the first call only starts the measurement
        self.nvml = _load_nvml() if nvml == "import" else nvml
        self._gpus: list[Any] = []
        if self.nvml is not None:
            try:
                self.nvml.nvmlInit()
                self._gpus = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.nvml.nvmlDeviceGetCount())]
            except Exception as exc:  # no driver, no GPU: CPU metrics only
                log.info("rllog: no GPU metrics (%s)", exc)
                self.nvml = None

    def sample(self) -> dict[str, float]:
        """One sample; a measurement that fails is left out (never an exception)."""
        values: dict[str, float] = {}
        try:
            with self.process.oneshot():
                values[PREFIX + "cpu_percent"] = float(self.process.cpu_percent(None))
                values[PREFIX + "memory_rss_mb"] = self.process.memory_info().rss / 2**20
                values[PREFIX + "threads"] = float(self.process.num_threads())
        except Exception as exc:  # the trainer is gone
            log.debug("rllog: cannot sample the trainer: %s", exc)
        for i, handle in enumerate(self._gpus):
            values.update(self._gpu(i, handle))
        return values

    def _gpu(self, i: int, handle: Any) -> dict[str, float]:
        nvml, key, out = self.nvml, f"{PREFIX}gpu.{i}.", {}
        readings = {
            "utilization": lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu,
            "memory_used_mb": lambda: nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20,
            "memory_percent": lambda: (
                100.0 * nvml.nvmlDeviceGetMemoryInfo(handle).used / nvml.nvmlDeviceGetMemoryInfo(handle).total
            ),
            "power_watts": lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "temperature_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        }
        for name, read in readings.items():
            try:
                out[key + name] = float(read())
            except Exception:  # a reading this GPU does not support
                continue
        return out


def _load_nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def run_sampler(pid: int, fd: int, interval: float, stop: threading.Event) -> threading.Thread:
    """Sample ``pid`` every ``interval`` s and write one JSON line per sample to ``fd`` (in the agent)."""

    def loop() -> None:
        try:
            sampler = SystemSampler(pid)
        except Exception as exc:
            log.warning("rllog: system metrics off: %s", exc)
            return
        with os.fdopen(fd, "w", buffering=1) as out:
            while not stop.wait(interval):
                values = sampler.sample()
                if values:
                    try:
                        out.write(json.dumps({"time": time.time(), "values": values}) + "\n")
                    except (BrokenPipeError, OSError):  # the trainer is gone or closed its end
                        return

    thread = threading.Thread(target=loop, name="rllog-system-metrics", daemon=True)
    thread.start()
    return thread


class SampleReader:
    """The trainer's end of the pipe: complete JSON lines, read without blocking."""

    def __init__(self, fd: int):
        os.set_blocking(fd, False)
        self.fd = fd
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        chunks = []
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        data = self._partial + b"".join(chunks)
        *lines, self._partial = data.split(b"\n")
        samples = []
        for line in lines:
            try:
                samples.append(json.loads(line))
            except ValueError:
                continue
        return samples

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
