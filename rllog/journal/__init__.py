"""The run's append-only journal: the source of truth between the trainer and every sink.

=========================  =========================================================================
``rllog.journal.format``   the on-disk format, as a spec (its docstring), framing, encoding, decoding
``rllog.journal.writer``   :class:`JournalWriter`: one background thread per run; full disks, partial writes
``rllog.journal.reader``   :class:`JournalReader` (resync, damage counted), :func:`read_all`, :func:`scan`
=========================  =========================================================================

The names below are this package's public API; import them from ``rllog.journal``.
"""

from rllog.journal.format import (
    DAMAGE_PLACES_KEPT,
    DECODE_ERRORS,
    HEADER,
    HEADER_PREFIX,
    KIND_ALERT,
    KIND_CONFIG,
    KIND_END,
    KIND_METRICS,
    KIND_TABLE,
    KIND_TABLE_COLUMNS,
    KINDS,
    MAGIC,
    MAX_FRAME,
    READ_ALL_BYTES,
    READ_CHUNK,
    SEGMENT_BYTES,
    SUFFIX,
    EncodedEntry,
    End,
    Record,
    decode_frame,
    encode_alert,
    encode_config,
    encode_end,
    encode_metrics,
    encode_table,
    encode_table_columns,
    frame,
    header_at,
    journal_dir,
    segment_key,
    segments,
)
from rllog.journal.reader import Damage, JournalReader, JournalScan, Scanner, last_seq, last_step, read_all, scan
from rllog.journal.writer import JournalWriter, PendingMetrics, PendingTable, WriterStats

__all__ = [
    "DAMAGE_PLACES_KEPT",
    "DECODE_ERRORS",
    "HEADER",
    "HEADER_PREFIX",
    "KINDS",
    "KIND_ALERT",
    "KIND_CONFIG",
    "KIND_END",
    "KIND_METRICS",
    "KIND_TABLE",
    "KIND_TABLE_COLUMNS",
    "MAGIC",
    "MAX_FRAME",
    "READ_ALL_BYTES",
    "READ_CHUNK",
    "SEGMENT_BYTES",
    "SUFFIX",
    "Damage",
    "EncodedEntry",
    "End",
    "JournalReader",
    "JournalScan",
    "JournalWriter",
    "PendingMetrics",
    "PendingTable",
    "Record",
    "Scanner",
    "WriterStats",
    "decode_frame",
    "encode_alert",
    "encode_config",
    "encode_end",
    "encode_metrics",
    "encode_table",
    "encode_table_columns",
    "frame",
    "header_at",
    "journal_dir",
    "last_seq",
    "last_step",
    "read_all",
    "scan",
    "segment_key",
    "segments",
]
