"""Why the daemon cannot start: the one line an operator reads, and the exit code.

Every layer that builds a part of the daemon raises these; the composition root
(:mod:`gpushare.daemon`) prints the line and exits with :attr:`StartupError.exit_code`.
"""

from __future__ import annotations


class StartupError(Exception):
    """The daemon cannot start; the message is the one line an operator reads."""

    #: The process exits with this: 2 for a configuration that cannot work, else 1.
    exit_code = 1


class ConfigurationRefused(StartupError):
    """The settings cannot work on this node: exit 2, like a bad value."""

    exit_code = 2


class NodeConfigurationError(ConfigurationRefused):
    """The settings do not fit this node's GPUs (e.g. cardModes names no such card)."""


class BadKubeletDir(ConfigurationRefused):
    """The kubelet's device-plugin directory is not there: a wrong path or mount."""


class ConfigurationTooLarge(ConfigurationRefused):
    """The settings cannot work on this node's GPUs (e.g. too many device IDs)."""


class BadLibrary(ConfigurationRefused):
    """``--library`` names a file that cannot enforce anything on this node."""
