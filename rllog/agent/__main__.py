"""``python -m rllog.agent``: see :mod:`rllog.agent.cli`."""

from rllog.agent.cli import main

main()
