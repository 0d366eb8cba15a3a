"""Error types shared by every tier; each message names the offending value."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as-is: missing, truncated, corrupt or unsupported."""


class RequestError(ValueError):
    """A caller's request that cannot be served (bad ids, too long, bad sampling values)."""


def check_prompt_ids(prompt: list[int], vocab_size: int, what: str = "prompt_token_ids") -> None:
    """RequestError unless prompt is a non-empty list of ids in [0, vocab_size)."""
    if not prompt:
        raise RequestError(f"{what} is empty")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
