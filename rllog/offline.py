"""The environment variables that keep every supported tracker offline (nothing leaves the machine).

Used by the test suite and the benchmarks; users can apply them the same way to try rllog
without accounts. ../shared/ENVIRONMENT.md explains each one.

Example:
    >>> import os
    >>> from rllog.offline import OFFLINE_ENV
    >>> for key, value in OFFLINE_ENV.items():
    ...     _ = os.environ.setdefault(key, value)
"""

from __future__ import annotations

OFFLINE_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_DISABLE_GIT": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "COMET_START_ONLINE": "false",
    "COMET_DISABLE_AUTO_LOGGING": "1",
    "COMET_ERROR_TRACKING_ENABLE": "false",
    "COMET_AUTO_LOG_ENV_HOST": "false",
    "SWANLAB_MODE": "offline",
    "CLEARML_OFFLINE_MODE": "1",
    "DVC_NO_ANALYTICS": "1",
    "DVC_STUDIO_OFFLINE": "true",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

# Variables that would point a tracker at a remote server or account.
ONLINE_VARS = (
    "TRACKIO_SPACE_ID",
    "TRACKIO_SERVER_URL",
    "WANDB_API_KEY",
    "COMET_API_KEY",
    "SWANLAB_API_KEY",
    "CLEARML_API_ACCESS_KEY",
    "CLEARML_API_SECRET_KEY",
    "DVC_STUDIO_TOKEN",
)
