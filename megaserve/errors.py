"""Error types shared by every tier; each message names the offending value."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as-is: missing, truncated, corrupt or unsupported."""


class RequestError(ValueError):
    """A caller's request that cannot be served (bad ids, too long, bad sampling values)."""
