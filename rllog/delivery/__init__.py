"""Delivery: followers that read the journal from each sink's cursor and write to the sink.

One owner per concern:

=============================  ===================================================================================
``rllog.delivery.follower``    :class:`Follower`: the loop (one thread per sink), routing records by kind, closing
``rllog.delivery.ledger``      :class:`DurableLedger`: what the sink holds durably, how far the cursor may move
``rllog.delivery.cursor``      :class:`CursorStore`, :class:`Cursor`, :class:`SinkState`: the cursor file
``rllog.delivery.calls``       :class:`RetryPolicy`, retries, suspects and dead letters, the re-send rule
``rllog.delivery.flush``       flush requests (:func:`request_flush`, :func:`wait_flushed`), :class:`FlushSchedule`,
                               :class:`FlushWatcher`, and every flush constant
``rllog.delivery.notices``     what the trainer's stderr is told when a sink fails or starts dead-lettering
=============================  ===================================================================================

The names below are this package's public API; import them from ``rllog.delivery``.
"""

from rllog.delivery.calls import DEAD_LETTERS_KEPT, LOCAL_RETRY_CAP, MAX_SUSPECTS, RetryPolicy, SpareDescriptors
from rllog.delivery.cursor import (
    CURSOR_FILE_BYTES,
    CURSOR_FORMAT,
    CURSOR_READ_TRIES,
    RETRY_NOTE,
    Cursor,
    CursorStore,
    SinkState,
    decode_cursor,
)
from rllog.delivery.flush import (
    ASKED_FLUSH_MIN_GAP,
    ASKED_RECORDS_PATIENCE,
    FINISH_DEADLINE,
    FLUSH_DUE_BYTES,
    FLUSH_DUE_RECORDS,
    FLUSH_REQUEST,
    FLUSH_WAKEUP,
    FLUSH_WATCH_IDLE_CHECK,
    LIVE_POLL_MAX,
    POLL_INTERVAL,
    SOON,
    WAITED,
    FlushRequest,
    FlushSchedule,
    FlushWatcher,
    finish_deadline,
    forget_finish_deadline,
    live_poll_interval,
    read_flush_request,
    request_flush,
    tell_finish_deadline,
    wait_flushed,
    wake_watcher,
)
from rllog.delivery.follower import BATCH_BYTES, BATCH_RECORDS, CURSOR_SAVE_RETRY, Follower
from rllog.delivery.ledger import DurableLedger

__all__ = [
    "ASKED_FLUSH_MIN_GAP",
    "ASKED_RECORDS_PATIENCE",
    "BATCH_BYTES",
    "BATCH_RECORDS",
    "CURSOR_FILE_BYTES",
    "CURSOR_FORMAT",
    "CURSOR_READ_TRIES",
    "CURSOR_SAVE_RETRY",
    "DEAD_LETTERS_KEPT",
    "FINISH_DEADLINE",
    "FLUSH_DUE_BYTES",
    "FLUSH_DUE_RECORDS",
    "FLUSH_REQUEST",
    "FLUSH_WAKEUP",
    "FLUSH_WATCH_IDLE_CHECK",
    "LIVE_POLL_MAX",
    "LOCAL_RETRY_CAP",
    "MAX_SUSPECTS",
    "POLL_INTERVAL",
    "RETRY_NOTE",
    "SOON",
    "WAITED",
    "Cursor",
    "CursorStore",
    "DurableLedger",
    "FlushRequest",
    "FlushSchedule",
    "FlushWatcher",
    "Follower",
    "RetryPolicy",
    "SinkState",
    "SpareDescriptors",
    "decode_cursor",
    "finish_deadline",
    "forget_finish_deadline",
    "live_poll_interval",
    "read_flush_request",
    "request_flush",
    "tell_finish_deadline",
    "wait_flushed",
    "wake_watcher",
]
