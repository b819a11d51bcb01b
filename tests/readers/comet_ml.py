"""Read a run back from Comet's offline archives (``<COMET_OFFLINE_DIRECTORY>/<key>-<suffix>.zip``).

An archive holds ``experiment.json`` (key, project, start/stop time, tags) and ``messages.json``
(JSON lines: ``metric_msg``, ``parameter_msg``, ``log_other``, ``file_upload`` with the asset file
stored in the zip under ``payload.file_path``). Every delivery session of a run writes its own archive
with the same experiment key; the archives of the run are those whose ``log_other`` ``rllog_run_id``
is the run's id, merged in start-time order.

Comet's own entries are left out: the ``process duration`` metric it adds at ``end``, ``sys.*``
system metrics, and parameters not logged by hand (``curr_step``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import zipfile
from pathlib import Path

from readers import ReadBack
from rllog_backends.comet import COLUMNS_KEY, RUN_ID_KEY, STATUS_KEY, TABLE_KEY, decode_cell

COMET_OWN_METRICS = {"process duration"}
SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _messages(archive: zipfile.ZipFile) -> list[dict]:
    lines = archive.read("messages.json").decode("utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def archives(offline_directory: str, run_id: str) -> list[tuple[dict, list[dict], zipfile.ZipFile]]:
    """The run's archives as (experiment.json, messages, zip), oldest session first."""
    found = []
    for path in sorted(Path(offline_directory).glob("*.zip")):
        archive = zipfile.ZipFile(path)
        if "messages.json" not in archive.namelist():
            continue
        messages = _messages(archive)
        run_ids = {
            m["payload"].get("value") for m in messages if m["type"] == "log_other" and m["payload"].get("key") == RUN_ID_KEY
        }
        if run_id not in run_ids:
            continue
        meta = json.loads(archive.read("experiment.json")) if "experiment.json" in archive.namelist() else {}
        found.append((meta, messages, archive))
    found.sort(key=lambda item: item[0].get("start_time") or 0)
    return found


def _value(value):
    return SPECIAL.get(value, value) if isinstance(value, str) else float(value)


def read_back(env: dict, run_info) -> ReadBack:
    out = ReadBack()
    for _meta, messages, archive in archives(env["COMET_OFFLINE_DIRECTORY"], run_info.run_id):
        for message in messages:
            kind, payload = message["type"], message["payload"]
            if kind == "metric_msg":
                metric = payload["metric"]
                name = metric["metricName"]
                if name in COMET_OWN_METRICS or name.startswith("sys."):
                    continue
                out.metrics.setdefault(name, []).append((metric["step"], _value(metric["metricValue"])))
            elif kind == "parameter_msg":
                param = payload["param"]
                if param.get("source") == "manual":
                    out.config[param["paramName"]] = param["paramValue"]
            elif kind == "log_other" and payload.get("key") == STATUS_KEY:
                out.status = payload["value"]
            elif kind == "file_upload" and TABLE_KEY in (payload.get("metadata") or {}):
                metadata = payload["metadata"]
                text = archive.read(payload["file_path"]).decode("utf-8")
                reader = csv.reader(io.StringIO(text, newline=""), dialect="excel")
                header = next(reader)
                kinds = dict(metadata[COLUMNS_KEY])
                rows = [
                    {name: decode_cell(cell, kinds[name]) for name, cell in zip(header, cells, strict=True)} for cells in reader
                ]
                step = payload["additional_params"]["step"]
                out.tables.setdefault(metadata[TABLE_KEY], []).append((step, rows))
    return out


# -- the contract suite's hooks (see readers/__init__.py) -------------------------------------------
def run_ids(env: dict, run_info) -> set[str]:
    """The experiment keys of every offline archive (a resumed run adds an archive, not an experiment)."""
    keys = set()
    for path in Path(env["COMET_OFFLINE_DIRECTORY"]).glob("*.zip"):
        with zipfile.ZipFile(path) as archive:
            if "experiment.json" in archive.namelist():
                keys.add(json.loads(archive.read("experiment.json"))["offline_id"])
    return keys


def break_next_write(monkeypatch, sink) -> None:
    """The 2nd ``log_metrics`` of the next call fails with Comet's own HTTP 502, after the 1st was logged."""
    import requests
    from comet_ml.exceptions import CometRestApiException

    experiment = sink._experiment
    real, calls = experiment.log_metrics, []

    def log_metrics(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            response = requests.Response()
            response.status_code, response._content = 502, b'{"msg": "bad gateway"}'
            response.url = "https://www.comet.com/api/rest/v2/write/experiment/metrics"
            raise CometRestApiException("POST", response)
        return real(*args, **kwargs)

    monkeypatch.setattr(experiment, "log_metrics", log_metrics)
