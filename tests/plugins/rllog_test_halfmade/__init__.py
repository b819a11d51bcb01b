"""A package built as ``asyncio`` is: star imports of its submodules, then a name bound only by their import.

An import of it cut after ``first`` (see ``first.py``) leaves ``rllog_test_halfmade.first`` in ``sys.modules`` but not
bound to the package, and the next import raises ``NameError: name 'first' is not defined``: what
``import asyncio`` raised in the explorer's agent after an import of it ran out of descriptors.
"""

from .first import *  # noqa: F403
from .second import *  # noqa: F403

__all__ = first.__all__ + second.__all__  # type: ignore[name-defined]  # noqa: F405
