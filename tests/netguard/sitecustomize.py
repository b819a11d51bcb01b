"""Loaded at start-up by Python processes the tests start: installs the network guard."""

import rllog_netguard  # noqa: F401
