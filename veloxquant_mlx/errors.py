"""The library's exceptions: one base, so callers can catch everything we raise on bad input."""


class VeloxQuantError(Exception):
    """Base of every error this library raises on purpose."""


class QuantizerConfigError(VeloxQuantError, ValueError):
    """A workload, configuration or cache argument is invalid; the message names field, value
    and what is allowed."""


class PolicyError(VeloxQuantError, ValueError):
    """A policy file is unreadable, malformed, invalid or cannot decide a workload; the message
    names the file, the line and column where known, the field and what is allowed."""
