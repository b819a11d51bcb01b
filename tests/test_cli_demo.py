"""``rllog demo`` shows rllog, not its libraries: their warnings off during the demo only, alerts above one bar."""

from __future__ import annotations

import logging
import warnings

from rllog.demo import progress_display, quiet_libraries


def test_rllog_messages_are_printed_above_the_one_progress_bar_and_nowhere_else(caplog):
    logger = logging.getLogger("rllog")
    with progress_display() as progress:
        progress.console.record = True
        task = progress.add_task("training", total=4)
        logging.getLogger("rllog.health").warning("rllog alert [kl_negative] step 3: kl is -0.5")
        progress.update(task, completed=4)
        shown = progress.console.export_text()
    assert "rllog alert [kl_negative] step 3: kl is -0.5" in shown
    assert not [r for r in caplog.records if r.name.startswith("rllog")]  # not printed a second time by the root logger
    assert logger.propagate and not any(type(h).__name__ == "RichHandler" for h in logger.handlers)  # as it was


def test_library_warnings_are_off_inside_the_demo_only():
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_libraries():
            warnings.warn("`gradient_checkpointing` is deprecated", FutureWarning, stacklevel=1)
            assert hf_logging.get_verbosity() == hf_logging.ERROR
        warnings.warn("a user's own deprecation", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a user's own deprecation"]
    assert hf_logging.get_verbosity() == before
