"""User-facing errors. Entry points print ``error: <message>`` and exit 2 for these, with no traceback.

Anything else is a bug and keeps its traceback. Messages name the key or file, the value, and the fix.
"""


class UltrascaleError(Exception):
    """Base class: a problem the user can fix without reading our code."""


class ConfigError(UltrascaleError):
    """A config key, value or combination that cannot work."""


class DataError(UltrascaleError):
    """Missing, corrupt or mismatched prepared data."""


class CheckpointError(UltrascaleError):
    """A missing, partial or incompatible checkpoint."""
