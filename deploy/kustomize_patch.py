"""Kustomize's two patch kinds for deploy/render.py: strategic merge (built-in kinds, lists
merged by their Kubernetes merge keys) and JSON6902 (add, remove, replace, test)."""

from __future__ import annotations

import copy
from typing import Any

Obj = dict[str, Any]

# Strategic-merge keys of the lists deploy/ patches (from the Kubernetes API's
# x-kubernetes-patch-merge-key). Any other list is replaced whole, as Kubernetes does for
# lists without a merge key (args, command, tolerations, ...).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
}


class RenderError(Exception):
    """The kustomization uses something this renderer does not implement, or is wrong."""


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` into a copy of `base` (the subset documented above)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        if "$patch" in patch:
            raise RenderError(f"unsupported directive $patch: {patch['$patch']} in {field}")
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = _merge_key(field, base + patch)
        if key is None:
            return copy.deepcopy(patch)
        # kustomize's order: the patch's items (merged into their base counterparts) first,
        # in patch order, then the base items the patch does not name.
        by_key = {b.get(key): b for b in base if isinstance(b, dict)}
        out, named = [], set()
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise RenderError(f"{field}: every patch item needs its merge key {key!r}")
            named.add(item[key])
            if item.get("$patch") == "delete":
                continue
            if item[key] in by_key:
                out.append(strategic_merge(by_key[item[key]], item, field))
            else:
                out.append(copy.deepcopy(item))
        return out + [copy.deepcopy(b) for b in base if b.get(key) not in named]
    return copy.deepcopy(patch)


def _merge_key(field: str, items: list) -> str | None:
    if field in MERGE_KEYS:
        return MERGE_KEYS[field]
    if field == "ports":  # container ports merge by containerPort, Service ports by port
        if all(isinstance(i, dict) and "containerPort" in i for i in items):
            return "containerPort"
        if all(isinstance(i, dict) and "port" in i for i in items):
            return "port"
    return None


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _step(node: Any, token: str, path: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise RenderError(f"JSON6902: {path}: no {token!r}")
        return node[token]
    if isinstance(node, list):
        if not token.isdigit() or int(token) >= len(node):
            raise RenderError(f"JSON6902: {path}: no index {token!r}")
        return node[int(token)]
    raise RenderError(f"JSON6902: {path}: cannot descend into a scalar")


def apply_json6902(o: Obj, ops: list[Obj]) -> None:
    """Applies JSON6902 operations (add, remove, replace, test) to `o` in place."""
    for op in ops:
        name, path = op.get("op"), op.get("path", "")
        tokens = _pointer(path)
        parent = o
        for t in tokens[:-1]:
            parent = _step(parent, t, path)
        last = tokens[-1]
        if name == "test":
            if _step(parent, last, path) != op["value"]:
                raise RenderError(f"JSON6902 test failed at {path}")
        elif name == "add":
            value = copy.deepcopy(op["value"])
            if isinstance(parent, list):
                if last == "-":
                    parent.append(value)
                elif last.isdigit() and int(last) <= len(parent):
                    parent.insert(int(last), value)
                else:
                    raise RenderError(f"JSON6902: {path}: bad index")
            elif isinstance(parent, dict):
                parent[last] = value
            else:
                raise RenderError(f"JSON6902: {path}: parent is a scalar")
        elif name in ("remove", "replace"):
            _step(parent, last, path)  # must exist
            if name == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            else:
                parent[int(last) if isinstance(parent, list) else last] = copy.deepcopy(op["value"])
        else:
            raise RenderError(f"JSON6902: unsupported op {name!r}")
