"""Exceptions the command line turns into a one-line message and a non-zero exit code."""


class PullbackError(Exception):
    """A user-facing error: bad argument, missing file, unusable checkpoint, ..."""


class CheckpointError(PullbackError):
    """A checkpoint or weights file is missing, corrupt, or does not fit the model."""
