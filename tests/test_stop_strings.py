"""StopStringMatcher: held-back partial stops, cuts before the first stop to complete."""

from __future__ import annotations

import random

import pytest

from router.stop_strings import MAX_STOP_CHARS, MAX_STOPS, StopStringMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None, list[str]]:
    """(all emitted text, matched stop, per-push outputs) for pushes then flush()."""
    m = StopStringMatcher(stops)
    outs = []
    for p in pieces:
        text, stopped = m.push(p)
        assert stopped == (m.matched is not None) == m.stopped
        outs.append(text)
    outs.append(m.flush())
    return "".join(outs), m.matched, outs


def first_completed(full: str, stops: list[str]) -> tuple[str, str | None]:
    """Brute force: the occurrence ending first (longest of those), output before its start."""
    best = None
    for s in stops:
        for i in range(len(full) - len(s) + 1):
            if full.startswith(s, i):
                key = (i + len(s), -len(s))
                if best is None or key < best[0]:
                    best = (key, i, s)
                break
    return (full, None) if best is None else (full[: best[1]], best[2])


def earliest_start(full: str, stops: list[str]) -> str:
    """The brief's reference: text before the earliest occurrence of any stop."""
    found = [i for s in stops if (i := full.find(s)) >= 0]
    return full[: min(found)] if found else full


def test_stop_split_char_by_char():
    text, matched, outs = run(["STOP"], list("abc STOP def"))
    assert (text, matched) == ("abc ", "STOP")
    assert outs[:4] == ["a", "b", "c", " "]  # emitted at once: no stop starts with them
    assert outs[4:8] == ["", "", "", ""]  # "S", "ST", "STO" held, then the match
    assert outs[8:] == ["", "", "", "", ""]  # input ignored after the stop


def test_stop_spanning_pushes():
    assert run(["<end>"], ["hello <e", "n", "d> more"])[:2] == ("hello ", "<end>")
    m = StopStringMatcher(["<end>"])
    assert m.push("hello <e") == ("hello ", False)
    assert m.push("nd") == ("", False)
    assert m.push(">tail") == ("", True)
    assert m.push("more") == ("", True) and m.flush() == "" and m.matched == "<end>"


def test_held_text_released_when_it_diverges():
    m = StopStringMatcher(["abc"])
    assert m.push("xab") == ("x", False)
    assert m.push("d") == ("abd", False)
    assert m.push("a") == ("", False)
    assert m.push("ab") == ("a", False)  # "aab": the held "ab" may still become "abc"
    assert m.flush() == "ab" and m.matched is None


def test_overlapping_stops():
    stops = ["ab", "abc", "bcd"]
    assert run(stops, list("xbcd"))[:2] == ("x", "bcd")
    assert run(stops, list("xabc"))[:2] == ("x", "ab")  # "ab" completes before "abc"
    assert run(stops, ["xbc", "d"])[:2] == ("x", "bcd")
    m = StopStringMatcher(stops)
    assert m.push("xb") == ("x", False)  # "b" could start "bcd"
    assert m.push("c") == ("", False)
    assert m.push("e") == ("bce", False) and m.flush() == ""


def test_stop_that_is_a_prefix_of_another():
    # both start at the same place: the output is the same, the shorter one completes first
    assert run(["end", "endless"], ["the endless"])[:2] == ("the ", "end")
    assert run(["endless", "end"], list("the endless"))[:2] == ("the ", "end")
    # ending at the same place, the longest (earliest-starting) one is reported
    assert run(["less", "endless"], ["the endless"])[:2] == ("the ", "endless")


def test_stop_inside_another_completes_first():
    """ "bc" lies inside "abcd" and completes first: stop there rather than wait for "d"."""
    assert run(["abcd", "bc"], list("xabcd"))[:2] == ("xa", "bc")
    assert run(["abcd", "bc"], ["xabcd"])[:2] == ("xa", "bc")  # same for one push


def test_multiple_matches_earliest_wins():
    assert run(["zz", "yy", "xx"], ["a yy b xx c zz"])[:2] == ("a ", "yy")
    assert run(["zz", "yy"], ["a zzyy"])[:2] == ("a ", "zz")
    assert run(["###"], ["a ### b ###"])[:2] == ("a ", "###")


def test_unicode_stops():
    assert run(["世界"], list("你好世界!"))[:2] == ("你好", "世界")
    assert run(["👩‍👧"], ["hi 👩", "\u200d", "👧 x"])[:2] == ("hi ", "👩‍👧")
    assert run(["e\u0301"], ["cafe", "\u0301!"])[:2] == ("caf", "e\u0301")
    assert run(["🎉"], ["no party 🎊"]) == ("no party 🎊", None, ["no party 🎊", ""])


def test_empty_pushes():
    m = StopStringMatcher(["ab"])
    assert m.push("") == ("", False)
    assert m.push("a") == ("", False)
    assert m.push("") == ("", False)
    assert m.push("b") == ("", True)
    assert m.push("") == ("", True)


def test_no_stops_passes_text_through():
    m = StopStringMatcher([])
    assert m.push("anything at all") == ("anything at all", False)
    assert m.push("") == ("", False)
    assert m.flush() == "" and m.matched is None


def test_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="''"):
        StopStringMatcher(["ok", ""])
    with pytest.raises(ValueError, match=f"{MAX_STOPS + 1} stop strings"):
        StopStringMatcher([f"s{i}" for i in range(MAX_STOPS + 1)])
    with pytest.raises(ValueError, match=f"{MAX_STOP_CHARS + 1} characters"):
        StopStringMatcher(["x" * (MAX_STOP_CHARS + 1)])
    with pytest.raises(ValueError, match="None"):
        StopStringMatcher(["ok", None])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="str"):
        StopStringMatcher("stop")  # type: ignore[arg-type]
    StopStringMatcher(["x" * MAX_STOP_CHARS] * MAX_STOPS)  # at the limits: fine


def test_randomized_against_brute_force():
    rng = random.Random(0)
    alphabet = "ab€c"
    for _ in range(3000):
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(0, 4))
        ]
        full = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        cuts = (
            sorted(rng.sample(range(1, len(full)), rng.randint(0, len(full) - 1)))
            if len(full) > 1
            else []
        )
        bounds = [0, *cuts, len(full)]
        pieces = [full[a:b] for a, b in zip(bounds, bounds[1:])]
        if rng.random() < 0.2:
            pieces.insert(rng.randint(0, len(pieces)), "")
        text, matched, _ = run(stops, pieces)
        assert (text, matched) == first_completed(full, stops), (stops, pieces)
        # No stop strictly inside another: also the text before the earliest-starting stop.
        if not any(s in t[1:-1] for s in stops for t in stops):
            assert text == earliest_start(full, stops), (stops, pieces)


def test_holds_back_only_a_possible_stop_prefix():
    """Before a stop, exactly the longest suffix that is a proper prefix of a stop is held."""
    rng = random.Random(1)
    for _ in range(1000):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        m, pushed, emitted = StopStringMatcher(stops), "", ""
        for _ in range(rng.randint(1, 10)):
            piece = "".join(rng.choices("abc", k=rng.randint(0, 3)))
            pushed += piece
            text, stopped = m.push(piece)
            emitted += text
            if stopped:
                break
            held = max(
                (
                    k
                    for k in range(1, len(pushed) + 1)
                    for s in stops
                    if k < len(s) and s.startswith(pushed[-k:])
                ),
                default=0,
            )
            assert emitted == pushed[: len(pushed) - held], (stops, pushed)
