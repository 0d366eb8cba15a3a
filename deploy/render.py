"""A small kustomize renderer for the subset of kustomize that deploy/ uses, for offline tests.

`kubectl apply -k` (or `kustomize build`) is what deploys; this module exists so the manifests
can be rendered and validated where neither binary is installed. It implements only what the
kustomizations under deploy/ use, and refuses anything else instead of guessing:

- `resources`: YAML files (several documents each) and directories holding a kustomization.
- `components`: directories holding a `kind: Component` kustomization; each is applied, in
  order, to the resources accumulated so far (its own resources are added, then its
  generators and patches run over everything).
- `namespace`: set on every namespaced object (Namespace and other cluster-scoped kinds are left
  alone).
- `labels`: `pairs`, `includeTemplates` (pod templates of built-in workload kinds);
  `includeSelectors: true` is refused.
- `configMapGenerator`: `name`, `files` (`path` or `key=path`), `literals`,
  `options.disableNameSuffixHash`. The name gets kustomize's content-hash suffix (same
  algorithm) and references in pod specs (volumes, env, envFrom, projected) are renamed.
- `patches`: `path` or inline `patch`, with an optional `target` (`group`, `version`, `kind`,
  `name` as a full-match regex). A mapping is a strategic-merge patch (built-in kinds only:
  lists merge by their Kubernetes merge keys, `null` deletes a key, `$patch: delete` on the
  top level deletes the object, `$patch: replace` replaces a mapping); a list is a JSON6902
  patch (`add`, `remove`, `replace`, `test`). A patch without a target must match exactly one
  object; a targeted patch may match none.
- `images`: `name`, `newName`, `newTag`, `digest`, applied to the containers of built-in
  workload kinds.

Usage: `python deploy/render.py deploy/overlays/gke-tpu7x > stack.yaml`.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from kustomize_patch import RenderError, apply_json6902, strategic_merge

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "components",
    "configMapGenerator",
    "patches",
    "images",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "PriorityClass",
    "StorageClass",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
}
# Built-in kinds whose pod template sits at spec.template (labels, images, name references).
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
BUILTIN_KINDS = (
    WORKLOADS
    | CLUSTER_SCOPED
    | {
        "ConfigMap",
        "Secret",
        "Service",
        "ServiceAccount",
        "PodDisruptionBudget",
        "PersistentVolumeClaim",
        "Role",
        "RoleBinding",
        "NetworkPolicy",
        "HorizontalPodAutoscaler",
        "CronJob",
        "Pod",
    }
)


def load_documents(path: Path) -> list[Obj]:
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise RenderError(f"{path}: every document must be an object with apiVersion/kind")
    return docs


def find_kustomization(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        if (directory / name).is_file():
            return directory / name
    raise RenderError(f"{directory}: no kustomization file")


def render(path: str | Path) -> list[Obj]:
    """Renders the kustomization in directory `path`; returns the objects."""
    directory = Path(path)
    k = yaml.safe_load(find_kustomization(directory).read_text())
    return render_kustomization(k, directory)


def render_kustomization(k: Obj, directory: Path, _component: bool = False) -> list[Obj]:
    """Renders an in-memory kustomization whose relative paths are relative to `directory`."""
    objs, names = _build(k, Path(directory), [], {}, component=_component)
    return objs


def _build(
    k: Obj, directory: Path, objs: list[Obj], names: dict[str, str], component: bool
) -> tuple[list[Obj], dict[str, str]]:
    unknown = set(k) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{directory}: unsupported kustomization fields {sorted(unknown)}")
    kind = k.get("kind", "Kustomization")
    if component and kind != "Component":
        raise RenderError(f"{directory}: listed under components but kind is {kind}")
    if not component and kind != "Kustomization":
        raise RenderError(f"{directory}: kind {kind} can only be used under components")
    objs = list(objs)
    names = dict(names)
    for entry in k.get("resources", []):
        p = directory / entry
        if p.is_dir():
            sub = yaml.safe_load(find_kustomization(p).read_text())
            sub_objs, sub_names = _build(sub, p, [], {}, component=False)
            objs += sub_objs
            names.update(sub_names)
        elif p.is_file():
            objs += load_documents(p)
        else:
            raise RenderError(f"{directory}: resource {entry} not found")
    for entry in k.get("components", []):
        p = directory / entry
        sub = yaml.safe_load(find_kustomization(p).read_text())
        objs, names = _build(sub, p, objs, names, component=True)
    for gen in k.get("configMapGenerator", []):
        cm, original = _config_map(gen, directory)
        names[original] = cm["metadata"]["name"]
        objs.append(cm)
    for patch in k.get("patches", []):
        objs = _apply_patch(patch, directory, objs)
    if "namespace" in k:
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    for spec in k.get("labels", []):
        _apply_labels(spec, objs)
    for img in k.get("images", []):
        _apply_image(img, objs)
    for o in objs:
        _rename_config_map_refs(o, names)
    _check_unique(objs, directory)
    return objs, names


def _check_unique(objs: list[Obj], directory: Path) -> None:
    seen = set()
    for o in objs:
        key = (o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])
        if key in seen:
            raise RenderError(f"{directory}: duplicate object {key}")
        seen.add(key)


# --- configMapGenerator ------------------------------------------------------------------


def _config_map(gen: Obj, directory: Path) -> tuple[Obj, str]:
    unknown = set(gen) - {"name", "files", "literals", "options"}
    if unknown or set(gen.get("options", {})) - {"disableNameSuffixHash"}:
        raise RenderError(f"{directory}: unsupported configMapGenerator fields in {gen}")
    data: dict[str, str] = {}
    for entry in gen.get("files", []):
        key, _, rel = entry.rpartition("=")
        p = directory / rel
        data[key or p.name] = p.read_text()
    for entry in gen.get("literals", []):
        key, sep, value = entry.partition("=")
        if not sep:
            raise RenderError(f"{directory}: literal {entry!r} is not key=value")
        data[key] = value
    name = gen["name"]
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
    if not gen.get("options", {}).get("disableNameSuffixHash", False):
        cm["metadata"]["name"] = f"{name}-{config_map_hash(data)}"
    return cm, name


def config_map_hash(data: dict[str, str]) -> str:
    """kustomize's ConfigMap name suffix: sha256 of the Go JSON of {data, kind, name}.

    kustomize (v5.5, checked against `kubectl kustomize`) hashes the generated object before
    it is named, so the name in the hashed JSON is empty.
    """
    encoded = json.dumps(
        {"data": data, "kind": "ConfigMap", "name": ""},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    # Go's encoding/json escapes HTML characters and the JS line separators.
    for ch, esc in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        encoded = encoded.replace(ch, esc)
    hexdigest = hashlib.sha256(encoded.encode()).hexdigest()
    return hexdigest[:10].translate(str.maketrans("013ae", "ghkmt"))


def _pod_specs(o: Obj) -> list[Obj]:
    """The pod specs of built-in workload kinds (what kustomize's transformers know)."""
    spec = o.get("spec") or {}
    if o["kind"] in WORKLOADS:
        return [spec.get("template", {}).get("spec", {})]
    if o["kind"] == "CronJob":
        return [spec.get("jobTemplate", {}).get("spec", {}).get("template", {}).get("spec", {})]
    if o["kind"] == "Pod":
        return [spec]
    return []


def _rename_config_map_refs(o: Obj, names: dict[str, str]) -> None:
    if not names:
        return
    for ps in _pod_specs(o):
        for v in ps.get("volumes", []):
            if "configMap" in v:
                v["configMap"]["name"] = names.get(v["configMap"]["name"], v["configMap"]["name"])
            for src in v.get("projected", {}).get("sources", []):
                if "configMap" in src:
                    n = src["configMap"]["name"]
                    src["configMap"]["name"] = names.get(n, n)
        for c in ps.get("containers", []) + ps.get("initContainers", []):
            for e in c.get("envFrom", []):
                if "configMapRef" in e:
                    n = e["configMapRef"]["name"]
                    e["configMapRef"]["name"] = names.get(n, n)
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("configMapKeyRef")
                if ref:
                    ref["name"] = names.get(ref["name"], ref["name"])


# --- labels and images -------------------------------------------------------------------


def _apply_labels(spec: Obj, objs: list[Obj]) -> None:
    unknown = set(spec) - {"pairs", "includeTemplates", "includeSelectors"}
    if unknown or spec.get("includeSelectors", False):
        raise RenderError(f"unsupported labels entry {spec} (includeSelectors: true is not)")
    pairs = spec["pairs"]
    for o in objs:
        o.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if spec.get("includeTemplates", False) and o["kind"] in WORKLOADS:
            tmpl = o["spec"]["template"].setdefault("metadata", {})
            tmpl.setdefault("labels", {}).update(pairs)


def _split_image(image: str) -> tuple[str, str]:
    """('repo/name', ':tag' or '@digest' or '')."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _apply_image(img: Obj, objs: list[Obj]) -> None:
    if set(img) - {"name", "newName", "newTag", "digest"}:
        raise RenderError(f"unsupported images entry {img}")
    for o in objs:
        for ps in _pod_specs(o):
            for c in ps.get("containers", []) + ps.get("initContainers", []):
                name, suffix = _split_image(c["image"])
                if name != img["name"]:
                    continue
                name = img.get("newName", name)
                if "digest" in img:
                    suffix = "@" + img["digest"]
                elif "newTag" in img:
                    suffix = ":" + img["newTag"]
                c["image"] = name + suffix


# --- patches -----------------------------------------------------------------------------


def _group_version(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


def _matches(o: Obj, target: Obj) -> bool:
    unknown = set(target) - {"group", "version", "kind", "name"}
    if unknown:
        raise RenderError(f"unsupported patch target fields {sorted(unknown)}")
    group, version = _group_version(o["apiVersion"])
    if "group" in target and target["group"] != group:
        return False
    if "version" in target and target["version"] != version:
        return False
    if "kind" in target and target["kind"] != o["kind"]:
        return False
    return "name" not in target or re.fullmatch(target["name"], o["metadata"]["name"]) is not None


def _apply_patch(entry: Obj, directory: Path, objs: list[Obj]) -> list[Obj]:
    if set(entry) - {"path", "patch", "target"} or ("path" in entry) == ("patch" in entry):
        raise RenderError(f"{directory}: a patch needs exactly one of path/patch: {entry}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    body = yaml.safe_load(text)
    target = entry.get("target")
    if isinstance(body, list):
        if target is None:
            raise RenderError(f"{directory}: a JSON6902 patch needs a target")
        hits = [o for o in objs if _matches(o, target)]
        for o in hits:
            apply_json6902(o, body)
        return objs
    if not isinstance(body, dict):
        raise RenderError(f"{directory}: a patch must be a mapping or a list of operations")
    if target is None:
        meta = body.get("metadata", {})
        target = {"kind": body.get("kind"), "name": re.escape(meta.get("name", ""))}
        group, version = _group_version(body.get("apiVersion", ""))
        target.update(group=group, version=version)
        hits = [o for o in objs if _matches(o, target)]
        if len(hits) != 1:
            raise RenderError(
                f"{directory}: patch for {body.get('kind')}/{meta.get('name')} matches "
                f"{len(hits)} objects, not one"
            )
    else:
        hits = [o for o in objs if _matches(o, target)]
    out = []
    for o in objs:
        if not any(o is h for h in hits):
            out.append(o)
            continue
        if o["kind"] not in BUILTIN_KINDS:
            raise RenderError(
                f"{directory}: strategic-merge patch on {o['kind']} (not a built-in kind, so "
                "kustomize would JSON-merge it); use a JSON6902 patch"
            )
        if body.get("$patch") == "delete":
            continue
        patch = {key: v for key, v in body.items() if key not in ("apiVersion", "kind")}
        patch["metadata"] = {
            key: v for key, v in patch.get("metadata", {}).items() if key != "name"
        }
        out.append(strategic_merge(o, patch))
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python deploy/render.py KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    try:
        objs = render(argv[0])
    except RenderError as e:
        print(f"render: {e}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(objs, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
