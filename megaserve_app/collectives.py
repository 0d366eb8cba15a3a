"""Collective ops read back from a compiled program's HLO: rounds and ICI bytes per device."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# One collective's defining line: `%name = <shape or (tuple)> kind[-start](`.
_OP = re.compile(
    r"%(?P<name>[\w.\-]+) = (?P<shape>\([^=]*?\)|[\w\[\],{}:()]+?) "
    r"(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(?P<dtype>pred|[a-z]+\d+(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5}
# replica_groups=mesh['tp'=8,'ep'=2] {'tp'} | replica_groups=[2,8]<=[16] | {{0,1},{2,3}}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<over>[^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int  # the result's bytes on one device
    group: int  # devices taking part

    @property
    def ici_bytes(self) -> float:
        """Bytes one device sends over ICI for it, with ring algorithms: an all-reduce is a
        reduce-scatter then an all-gather, 2 (n-1)/n of the buffer; an all-gather receives
        (n-1)/n of its result; a reduce-scatter sends (n-1) of its (1/n-sized) result; an
        all-to-all keeps 1/n; a permute sends all of it."""
        n = self.group
        if n <= 1:
            return 0.0
        return (
            self.bytes
            * {
                "all-reduce": 2 * (n - 1) / n,
                "all-gather": (n - 1) / n,
                "reduce-scatter": n - 1,
                "all-to-all": (n - 1) / n,
                "collective-permute": 1.0,
            }[self.kind]
        )


def _shape_bytes(shape: str) -> int:
    total = 0.0
    for m in _ARRAY.finditer(shape):
        dims = [int(x) for x in m["dims"].split(",") if x]
        width = _BYTES.get(m["dtype"]) or int(re.search(r"\d+", m["dtype"])[0]) / 8
        total += math.prod(dims) * width
    return int(total)


def _group_size(line: str) -> int:
    m = _MESH_GROUPS.search(line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m["axes"]))
        over = re.findall(r"'(\w+)'", m["over"])
        return math.prod(int(sizes[a]) for a in over)
    m = _IOTA_GROUPS.search(line)
    if m:
        return int(m[2])
    m = _LIST_GROUPS.search(line)
    if m:
        return len([x for x in m["first"].split(",") if x])
    return 2 if "source_target_pairs" in line else 1


def collectives(hlo: str) -> list[Collective]:
    """Every collective the program runs once per call (each op's defining line counted
    once; async pairs by their start). Ops inside a loop body count once: callers pass
    programs whose loops hold none (the decode scan of one step, the prefill key loop)."""
    seen, out = set(), []
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m is None or m["name"] in seen:
            continue
        seen.add(m["name"])
        shape = m["shape"]
        if m["start"]:  # an async start's tuple is (operands..., result): the result counts
            shape = list(_ARRAY.finditer(shape))[-1][0]
        out.append(Collective(m["kind"], _shape_bytes(shape), _group_size(line)))
    return out


def summarize(ops: list[Collective]) -> dict:
    """Rounds (ops) by kind, and the ICI bytes one device sends per call."""
    return {
        "collective_rounds": len(ops),
        "collective_rounds_by_kind": dict(Counter(op.kind for op in ops)),
        "ici_bytes_per_device": int(sum(op.ici_bytes for op in ops)),
        "collective_buffer_bytes": sum(op.bytes for op in ops),
    }
