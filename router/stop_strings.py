"""Stop strings over streamed text: hold back a possible partial stop, cut before a match."""

from __future__ import annotations

MAX_STOPS = 16
MAX_STOP_CHARS = 256


def validate_stops(stops: list[str]) -> list[str]:
    """The distinct stop strings, in order; ValueError naming the first bad one."""
    if not isinstance(stops, (list, tuple)):
        raise ValueError(f"stop strings must be a list of strings, got {type(stops).__name__}")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"{len(stops)} stop strings given, at most {MAX_STOPS} allowed")
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"stop string {s!r} is a {type(s).__name__}, not a string")
        if not s:
            raise ValueError("stop string '' is empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(
                f"stop string {s[:32]!r}... has {len(s)} characters, at most {MAX_STOP_CHARS}"
            )
    return list(dict.fromkeys(stops))


class StopStringMatcher:
    """Streams text through, stopping at the first stop string to complete.

    push() emits everything except the longest suffix of the pending text that is a prefix of
    some stop (it may still become one). The stream stops as soon as any stop completes (so
    generation can end at once): with full = all text pushed, the match is the occurrence that
    ends first, and of those ending there the longest; the output is full[:its start]. That is
    full[:earliest start of any stop] unless one stop lies strictly inside another (stops "bc"
    and "abcd" on "abcd" give "a": "bc" completes first).
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = validate_stops(stops)
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched); ignores input once stopped."""
        if self.matched is not None:
            return "", True
        if not self._stops:
            return text, False
        # Matches that start in already emitted text are impossible: their start is held.
        buf = self._held + text
        best: tuple[int, int, str] | None = None  # (end, -length, stop): first end, then longest
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), -len(s)) < best[:2]):
                best = (i + len(s), -len(s), s)
        if best is not None:
            end, neg_len, s = best
            self.matched = s
            self._held = ""
            return buf[: end + neg_len], True
        keep = self._partial_len(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _partial_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop."""
        best = 0
        for s in self._stops:
            # Only suffixes that begin with s[0] can be prefixes of s; scan those longest first.
            start = max(len(buf) - len(s) + 1, 0)
            i = buf.find(s[0], start)
            while i >= 0 and len(buf) - i > best:
                if s.startswith(buf[i:]):
                    best = len(buf) - i
                    break
                i = buf.find(s[0], i + 1)
        return best

    def flush(self) -> str:
        """At end of stream without a stop, the held-back text."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
