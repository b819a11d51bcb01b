"""Once per ``$RLLOG_TEST_CUT_IMPORT`` (a marker file it creates), leaves this process no descriptor for ``0.5 s``
(a real ``RLIMIT_NOFILE``), so the package's import of ``second`` fails for want of one."""

import os
import resource
import threading

__all__ = ["FIRST"]
FIRST = 1

_marker = os.environ.get("RLLOG_TEST_CUT_IMPORT")
if _marker and not os.path.exists(_marker):
    open(_marker, "w").close()
    _soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    _lowest_free = os.dup(0)
    os.close(_lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free, _hard))
    threading.Timer(0.5, resource.setrlimit, (resource.RLIMIT_NOFILE, (_soft, _hard))).start()
