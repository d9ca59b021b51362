"""The library's exceptions: one hierarchy for mistakes in what a user passed in.

``PullbackError`` is a ``ValueError``, so code that already catches ``ValueError`` for a bad
argument keeps working. The command line turns these (and only these) into a one-line message
and exit code 2; any other exception is a bug and keeps its traceback.
"""


class PullbackError(ValueError):
    """A bad argument or value given to the library or the command line."""


class CheckpointError(PullbackError):
    """A checkpoint or weights file is missing, corrupt, or does not fit the model."""


class DataError(PullbackError):
    """An image, target or data file or folder is missing or unusable."""
