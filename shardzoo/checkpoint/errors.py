"""The one exception type of shardzoo.checkpoint."""


class CheckpointError(ValueError):
    """A checkpoint cannot be written or read as asked. The message names the file or tensor,
    the rule that failed and what to do about it."""
