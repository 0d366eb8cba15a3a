"""Re-layouts of the KV pool or a weight in a compiled program's HLO: buffers the program
makes from the pool or a weight by moving its data, read from the ENTRY computation."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Ops that move (part of) a buffer without computing: what derives from a weight stays
# "the weight" through them (slices of a layer, prefetches into VMEM, tuple elements).
_MOVES = {
    "bitcast", "get-tuple-element", "slice", "slice-start", "slice-done", "dynamic-slice",
    "copy-start", "copy-done",
}  # fmt: skip
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\](\{[^}]*\})?")
_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*")


@dataclass(frozen=True)
class _Instr:
    name: str
    op: str
    arrays: tuple[tuple[tuple[int, ...], str], ...]  # (dims, layout) of each result array
    operands: tuple[str, ...]
    target: str  # a custom-call's target
    line: str


def _closing(s: str, depth: int = 0) -> int:
    """Index of the parenthesis that brings `depth` (open ones before s) back to 0."""
    for i, c in enumerate(s):
        depth += c == "("
        depth -= c == ")"
        if depth == 0:
            return i
    return len(s)


def _split_type(rest: str) -> tuple[str, str]:
    """(result type, what follows) of an instruction's right-hand side."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    end = _closing(rest) + 1
    return rest[:end], rest[end:].lstrip()


def _computations(hlo: str) -> dict[str, str]:
    """Each non-ENTRY computation's body by name (fusions are read for a dot)."""
    out, name, body = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^%([\w.\-]+) .*\{\s*$", line)
        if m:
            name, body = m.group(1), []
        elif line.startswith("}") and name:
            out[name], name = "\n".join(body), None
        elif name:
            body.append(line)
    return out


def _entry(hlo: str) -> list[_Instr]:
    out, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if not inside:
            continue
        if line.startswith("}"):
            break
        m = _HEAD.match(line)
        if not m:
            continue
        ty, tail = _split_type(line[m.end() :])
        op, _, args = tail.partition("(")
        end = _closing(args, depth=1)
        arrays = tuple(
            (tuple(int(d) for d in a.group(2).split(",")), a.group(3) or "")
            for a in _ARRAY.finditer(ty)
            if a.group(2)
        )
        target = re.search(r'custom_call_target="([^"]+)"', line)
        out.append(
            _Instr(
                m.group(1), op.strip(), arrays, tuple(re.findall(r"%([\w.\-]+)", args[:end])),
                target.group(1) if target else "", line.strip(),
            )
        )  # fmt: skip
    return out


# Buffers below this many elements (512 KB in bf16) are activations or norm rows, whatever
# weight they were computed from (a batch-1 token's hidden row has a norm weight's dims).
_SMALL = 2**18
_VMEM = "S(1)"


def _tiling(layout: str) -> str:
    """The minor-to-major order and tiling of a layout, without its memory space."""
    return re.sub(r"S\(\d+\)", "", layout)


def relayout_ops(hlo: str, pool_shape: tuple[int, ...], weight_shapes: list[tuple]) -> list[str]:
    """HLO lines (ENTRY computation) that re-lay out or copy the pool or a weight.

    A source is a parameter with the pool's or a weight's exact dims; what slices, bitcasts,
    prefetches or tuple-selects it stays that source. Flagged: a copy or transpose of a
    source (where the layout changes, or HBM to HBM); a layout/data-format custom call on
    one; and, for weights, any other op making a buffer of at least one layer's worth of the
    weight from it (a relayout fused with a slice, a cast). The pool's in-place updates
    (same layout) are not flagged.
    """
    shapes = {tuple(s): "weight" for s in weight_shapes}
    shapes[tuple(pool_shape)] = "pool"  # a weight of the pool's dims is still the pool
    bodies = _computations(hlo)
    # name -> (kind, one layer's elements, layout, dims) of what the value holds
    source: dict[str, tuple[str, int, str, tuple[int, ...]]] = {}
    flagged = []
    for ins in _entry(hlo):
        if ins.op == "parameter" and len(ins.arrays) == 1:
            dims, layout = ins.arrays[0]
            if dims in shapes:
                layer = math.prod(dims) // max(dims[0], 1) if len(dims) > 2 else math.prod(dims)
                source[ins.name] = (shapes[dims], layer, layout, dims)
            continue
        srcs = [source[o] for o in ins.operands if o in source]
        if not srcs:
            continue
        kind, layer, src_layout, src_dims = srcs[0]
        if ins.op in _MOVES or (ins.op == "custom-call" and ins.target == "ConcatBitcast"):
            if ins.op == "bitcast" and len(ins.arrays) == 1:
                # Same bytes under new dims (the pool as [L*pages*page, row] for a scatter):
                # later ops compare against this view's layout.
                source[ins.name] = (kind, layer, *reversed(ins.arrays[0]))
            else:
                source[ins.name] = srcs[0]
            continue
        # An async op's result tuple carries its operands through: those are not new buffers.
        made = [(d, lay) for d, lay in ins.arrays if (d, lay) != (src_dims, src_layout)]
        relaid = any(_tiling(lay) != _tiling(src_layout) for _, lay in made)
        big = any(math.prod(d) >= max(layer, _SMALL) for d, _ in made)
        if all(_VMEM in lay for _, lay in ins.arrays) and ins.op != "custom-call":
            # Loaded into VMEM (re-tiled for the MXU on the way, as XLA feeds every matmul):
            # the resident copy stays the only one in HBM, and VMEM cannot hold a weight.
            continue
        if ins.op in ("copy", "transpose", "reshape"):
            hbm_to_hbm = not any("S(" in lay for _, lay in ins.arrays)
            hit = relaid or hbm_to_hbm
        elif ins.op == "custom-call":
            hit = bool(re.search(r"(?i)layout|format", ins.target))
        elif ins.op == "fusion":
            called = re.search(r"calls=%([\w.\-]+)", ins.line)
            body = bodies.get(called.group(1), "") if called else ""
            computes = re.search(r"\b(dot|convolution|custom-call)\(", body)
            # A fusion without a dot that makes a layer's worth from a weight moved it (a
            # relayout fused with a slice, a cast); the pool's in-place updates keep its layout.
            hit = big and not computes and (kind == "weight" or relaid)
        else:
            hit = big and (kind == "weight" or relaid)
        if hit:
            flagged.append(ins.line[:200])
    return flagged
