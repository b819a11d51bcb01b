"""Turning what users pass to ``log``/``log_table``/``init(config=...)`` into validated plain data, on the caller's
thread: :mod:`~rllog.validate.metrics` (metrics, steps), :mod:`~rllog.validate.tables` (tables and their columns
from call to call), :mod:`~rllog.validate.config` (configs flattened), :mod:`~rllog.validate.secrets` (credentials
redacted), :mod:`~rllog.validate.nesting` (how deep a value may nest)."""

from __future__ import annotations

from rllog.validate.config import flatten_config
from rllog.validate.metrics import INT64_MAX, check_step, flatten, is_tensor, normalise_metrics, stack_scalars, to_scalar
from rllog.validate.nesting import MAX_NESTING_DEPTH, check_nesting
from rllog.validate.secrets import REDACTED, is_secret_key, redact, redact_args, redact_text
from rllog.validate.tables import PROMOTION_RULE, RESERVED_TABLE_COLUMNS, TableColumns, TableSchemas, to_arrow_table

__all__ = [
    "INT64_MAX",
    "MAX_NESTING_DEPTH",
    "PROMOTION_RULE",
    "REDACTED",
    "RESERVED_TABLE_COLUMNS",
    "TableColumns",
    "TableSchemas",
    "check_nesting",
    "check_step",
    "flatten",
    "flatten_config",
    "is_secret_key",
    "is_tensor",
    "normalise_metrics",
    "redact",
    "redact_args",
    "redact_text",
    "stack_scalars",
    "to_arrow_table",
    "to_scalar",
]
