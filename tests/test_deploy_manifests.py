"""Offline checks of the Kubernetes manifests under deploy/ (no cluster, no kustomize binary).

Every kustomization is rendered by deploy/render.py; every object is validated against the
Kubernetes 1.34 OpenAPI schemas (kubernetes-validate, strict: unknown fields fail); the
LeaderWorkerSet CRD against the reduced schema in deploy/schemas/ plus its pod templates as
core PodTemplateSpecs; then the invariants a schema cannot see (probes on the served port,
TPU requests, selectors, flags the CLI accepts, ...). Each invariant is a function returning
a list of problems, and the negative tests feed them broken manifests.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import re
import shutil
import subprocess
import sys
from math import prod
from pathlib import Path
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
sys.path.insert(0, str(DEPLOY))
import render  # noqa: E402

# GKE runs Ironwood (TPU7x) from 1.34.0-gke.2201000, so 1.34 is the oldest API to satisfy.
K8S_VERSION = "1.34"
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_SCHEMA = yaml.safe_load((DEPLOY / "schemas" / "leaderworkerset-v1.schema.yaml").read_text())
# Variables the LWS controller puts first in every container of a group (so $(...) expands).
LWS_INJECTED = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}
SERVER_COMMANDS = {"router", "decode-worker", "prefill-worker"}
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")
# Flags/commands the manifests may use ahead of the code: dropped before parsing while the
# CLI lacks them; test_cli_catches_up fails while any is still missing. None at present.
PENDING_FLAGS: set[str] = set()
PENDING_COMMANDS: set[str] = set()
# Secrets created outside the manifests (README); everything else must exist in the render.
EXTERNAL_SECRETS = {"megaserve-tls", "megaserve-api-token"}
TPU_CHIPS_PER_HOST = {"tpu7x": 4}  # tpu7x-standard-4t: 4 chips per VM
TPU_DEVICES_PER_CHIP = {"tpu7x": 2}  # each TensorCore is a JAX device
# What a multi-host decode worker reads to join its group (megaserve/parallel/distributed.py).
GROUP_ENV = {
    "JAX_COORDINATOR_ADDRESS": "$(LWS_LEADER_ADDRESS):",
    "JAX_NUM_PROCESSES": "$(LWS_GROUP_SIZE)",
    "JAX_PROCESS_ID": "$(LWS_WORKER_INDEX)",
}
LOADBALANCER_KEYS = {
    "prefill_policy": str,
    "decode_policy": str,
    "prefill_load_scale": float,
    "busy_threshold_running": int,
    "busy_threshold_kv_usage": float,
    "disagg_min_uncached_tokens": int,
    "session_ttl_s": int,
    "retry_max_attempts": int,
    "retry_base_delay_ms": int,
    "circuit_breaker_failures": int,
    "circuit_breaker_reset_s": float,
    "state_refresh_ms": int,
}

OVERLAYS = DEPLOY / "overlays"
TARGETS = {
    "base": DEPLOY / "base",
    "cpu-local": OVERLAYS / "cpu-local",
    "gke-tpu7x": OVERLAYS / "gke-tpu7x",
    "gke-tpu7x-tls": OVERLAYS / "gke-tpu7x-tls",
    # The TLS component over the base (decode as a Deployment); no directory of its own.
    "base+tls": {"resources": ["../base"], "components": ["tls"]},
    # Redis primary + replica behind three Sentinels (a Component), over the base and gke-tpu7x.
    "base+redis-sentinel": {"resources": ["../base"], "components": ["redis-sentinel"]},
    "gke-tpu7x+redis-sentinel": {"resources": ["gke-tpu7x"], "components": ["redis-sentinel"]},
}


def render_target(name: str) -> list[dict]:
    t = TARGETS[name]
    if isinstance(t, dict):
        return render.render_kustomization(t, OVERLAYS)
    return render.render(t)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render_target(name) for name in TARGETS}


# --- helpers -----------------------------------------------------------------------------


def pod_templates(objs: list[dict]) -> list[tuple[str, dict]]:
    """(owner, pod template) for every workload in the render."""
    out = []
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in render.WORKLOADS:
            out.append((name, o["spec"]["template"]))
        elif o["apiVersion"] == LWS_API:
            lwt = o["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                if role in lwt:
                    out.append((f"{name}[{role}]", lwt[role]))
    return out


def containers(objs: list[dict]):
    for owner, tmpl in pod_templates(objs):
        for c in tmpl["spec"].get("containers", []) + tmpl["spec"].get("initContainers", []):
            yield owner, tmpl, c


def is_lws(owner: str) -> bool:
    return owner.startswith("LeaderWorkerSet/")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion (an undefined variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


def container_env(owner: str, c: dict) -> dict[str, str]:
    """The container's environment with stand-ins for values only a running pod has."""
    env = {}
    if is_lws(owner):
        env = {"LWS_LEADER_ADDRESS": "lws-0.lws", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0"}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        else:
            field = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            env[e["name"]] = {"status.podIP": "10.0.0.7", "metadata.name": "pod-0"}.get(
                field, "stand-in"
            )
    return env


def args_of(owner: str, c: dict) -> list[str]:
    env = container_env(owner, c)
    return [expand(a, env) for a in c.get("args", [])]


def flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def is_server(c: dict) -> bool:
    return (
        c.get("command") == ["megaserve"]
        and bool(c.get("args"))
        and (c["args"][0] in SERVER_COMMANDS)
    )


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --- schema validation -------------------------------------------------------------------


def validate_object(o: dict) -> list[str]:
    """Schema problems of one object (strict: unknown fields are problems)."""
    name = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
    if o.get("apiVersion") == LWS_API:
        v = jsonschema.Draft202012Validator(LWS_SCHEMA)
        problems = [f"{name}: {'.'.join(map(str, e.path))}: {e.message}" for e in v.iter_errors(o)]
        lwt = o.get("spec", {}).get("leaderWorkerTemplate", {})
        for role in ("leaderTemplate", "workerTemplate"):
            if isinstance(lwt.get(role), dict):
                wrapped = {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{o['metadata']['name']}-{role.lower()}"},
                    "template": lwt[role],
                }
                problems += [f"{name}[{role}]: {p}" for p in validate_object(wrapped)]
        return problems
    try:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [f"{name}: {e.message}"]
    return []


@pytest.mark.parametrize("target", TARGETS)
def test_objects_match_kubernetes_schemas(rendered, target):
    objs = rendered[target]
    assert objs
    problems = [p for o in objs for p in validate_object(o)]
    assert not problems, "\n".join(problems)


# --- invariants --------------------------------------------------------------------------


def check_resources(objs: list[dict]) -> list[str]:
    problems = []
    for owner, _, c in containers(objs):
        res = c.get("resources", {})
        for kind, keys in (("requests", ("cpu", "memory")), ("limits", ("memory",))):
            missing = [k for k in keys if k not in res.get(kind, {})]
            if missing:
                problems.append(f"{owner}/{c['name']}: no {kind} for {missing}")
    return problems


def followers(objs: list[dict]) -> set[str]:
    """Owners of the follower pods of LeaderWorkerSets whose leader has its own template:
    followers of a multi-host group run no server (megaserve/parallel/group.py)."""
    out = set()
    for o in objs:
        if o["apiVersion"] == LWS_API and "leaderTemplate" in o["spec"]["leaderWorkerTemplate"]:
            out.add(f"LeaderWorkerSet/{o['metadata']['name']}[workerTemplate]")
    return out


def check_probes(objs: list[dict]) -> list[str]:
    """A gRPC server probes the port it serves: native gRPC probes in plaintext, TCP with TLS
    (the kubelet's gRPC probe cannot speak TLS); workers also get a startup probe. A group's
    followers serve nothing: no probes."""
    problems = []
    silent = followers(objs)
    for owner, _, c in containers(objs):
        where = f"{owner}/{c['name']}"
        if owner in silent:
            probes = [p for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in c]
            if probes:
                problems.append(f"{where}: a follower serves nothing to probe: {probes}")
            continue
        declared = {p["containerPort"] for p in c.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            for handler in ("grpc", "tcpSocket", "httpGet"):
                port = c.get(probe, {}).get(handler, {}).get("port")
                if isinstance(port, int) and port not in declared:
                    problems.append(f"{where}: {probe} port {port} is not a containerPort")
        if not is_server(c):
            continue
        args = args_of(owner, c)
        port = flag_value(args, "--port")
        if port is None or not port.isdigit():
            problems.append(f"{where}: no numeric --port")
            continue
        port = int(port)
        if port not in declared:
            problems.append(f"{where}: --port {port} is not a declared containerPort")
        tls = flag_value(args, "--tls-cert") is not None
        wanted = ["readinessProbe", "livenessProbe"]
        if args[0] != "router":
            wanted.append("startupProbe")
        for probe in wanted:
            p = c.get(probe)
            # The router's health is NOT_SERVING until it has workers: liveness must not
            # restart it for that, so it only checks that the port answers.
            router_liveness = args[0] == "router" and probe == "livenessProbe"
            if p is None:
                problems.append(f"{where}: no {probe}")
            elif router_liveness and p.get("tcpSocket", {}).get("port") != port:
                problems.append(f"{where}: {probe} must be tcpSocket on {port}: {p}")
            elif router_liveness:
                continue
            elif tls and p.get("tcpSocket", {}).get("port") != port:
                problems.append(f"{where}: {probe} must be tcpSocket on {port} with TLS: {p}")
            elif not tls and p.get("grpc", {}).get("port") != port:
                problems.append(f"{where}: {probe} must be a grpc probe on {port}: {p}")
    return problems


def check_tpu(objs: list[dict]) -> list[str]:
    """TPU pods request whole hosts (requests == limits == chips per host), select a TPU7x
    node pool, and an LWS group has as many pods as its slice topology has hosts."""
    problems = []
    for owner, tmpl, c in containers(objs):
        res = c.get("resources", {})
        req = res.get("requests", {}).get("google.com/tpu")
        lim = res.get("limits", {}).get("google.com/tpu")
        if req is None and lim is None:
            continue
        where = f"{owner}/{c['name']}"
        if req != lim:
            problems.append(f"{where}: google.com/tpu request {req} != limit {lim}")
        sel = tmpl["spec"].get("nodeSelector", {})
        acc = sel.get("cloud.google.com/gke-tpu-accelerator")
        topo = sel.get("cloud.google.com/gke-tpu-topology")
        if acc not in TPU_CHIPS_PER_HOST or not topo:
            problems.append(f"{where}: nodeSelector lacks a known TPU accelerator/topology")
            continue
        per_host = TPU_CHIPS_PER_HOST[acc]
        if str(lim) != str(per_host):
            problems.append(f"{where}: {lim} chips, a {acc} host has {per_host}")
        hosts = prod(int(x) for x in topo.split("x")) // per_host
        if hosts > 1 and not is_lws(owner):
            problems.append(f"{where}: {topo} is {hosts} hosts; needs a LeaderWorkerSet")
    for o in objs:
        if o["apiVersion"] != LWS_API:
            continue
        lwt = o["spec"]["leaderWorkerTemplate"]
        sel = lwt["workerTemplate"]["spec"].get("nodeSelector", {})
        topo = sel.get("cloud.google.com/gke-tpu-topology")
        acc = sel.get("cloud.google.com/gke-tpu-accelerator")
        if topo and acc in TPU_CHIPS_PER_HOST:
            hosts = prod(int(x) for x in topo.split("x")) // TPU_CHIPS_PER_HOST[acc]
            if lwt.get("size", 1) != hosts:
                problems.append(
                    f"LeaderWorkerSet/{o['metadata']['name']}: size {lwt.get('size', 1)} "
                    f"but topology {topo} has {hosts} hosts"
                )
    return problems


def check_selectors(objs: list[dict]) -> list[str]:
    """Workload selectors match their own templates; PDBs and Services select existing pods;
    Service target ports are declared by every selected pod."""
    problems = []
    tmpls = pod_templates(objs)
    ns_of = {owner: o["metadata"].get("namespace") for o in objs for owner, _ in pod_templates([o])}
    for o in objs:
        if o["kind"] in render.WORKLOADS:
            sel = o["spec"]["selector"]["matchLabels"]
            if not selects(sel, o["spec"]["template"]["metadata"].get("labels", {})):
                problems.append(f"{o['kind']}/{o['metadata']['name']}: selector misses template")
        if o["kind"] not in ("Service", "PodDisruptionBudget"):
            continue
        name = f"{o['kind']}/{o['metadata']['name']}"
        sel = o["spec"].get("selector", {})
        sel = sel.get("matchLabels", sel) if o["kind"] == "PodDisruptionBudget" else sel
        hit = [
            t
            for owner, t in tmpls
            if ns_of[owner] == o["metadata"].get("namespace")
            and selects(sel, t["metadata"].get("labels", {}))
        ]
        if not sel or not hit:
            problems.append(f"{name}: selector {sel} selects no pods")
            continue
        if o["kind"] != "Service":
            continue
        for p in o["spec"].get("ports", []):
            target = p.get("targetPort", p["port"])
            for t in hit:
                ports = [cp for c in t["spec"]["containers"] for cp in c.get("ports", [])]
                if not any(target in (cp.get("name"), cp["containerPort"]) for cp in ports):
                    problems.append(f"{name}: targetPort {target} not declared by its pods")
    lws_names = {o["metadata"]["name"] for o in objs if o["apiVersion"] == LWS_API}
    for o in objs:  # the LWS controller creates a headless Service named after each LWS
        if o["kind"] == "Service" and o["metadata"]["name"] in lws_names:
            problems.append(f"Service/{o['metadata']['name']}: clashes with the LWS's Service")
    return problems


def check_references(objs: list[dict]) -> list[str]:
    """ConfigMaps, Secrets and ServiceAccounts that pods use exist (or are external)."""
    problems = []
    have = {(o["kind"], o["metadata"]["name"]) for o in objs}
    claims = {  # a StatefulSet's volumeClaimTemplates are volumes of its pods too
        f"{o['kind']}/{o['metadata']['name']}": {
            t["metadata"]["name"] for t in o["spec"].get("volumeClaimTemplates", [])
        }
        for o in objs
        if o["kind"] == "StatefulSet"
    }
    for owner, tmpl, c in containers(objs):
        spec = tmpl["spec"]
        sa = spec.get("serviceAccountName")
        if sa and ("ServiceAccount", sa) not in have:
            problems.append(f"{owner}: ServiceAccount {sa} does not exist")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes and m["name"] not in claims.get(owner, ()):
                problems.append(f"{owner}/{c['name']}: mount of undefined volume {m['name']}")
        for v in volumes.values():
            if "configMap" in v and ("ConfigMap", v["configMap"]["name"]) not in have:
                problems.append(f"{owner}: ConfigMap {v['configMap']['name']} does not exist")
            secret = v.get("secret", {}).get("secretName")
            if secret and ("Secret", secret) not in have and secret not in EXTERNAL_SECRETS:
                problems.append(f"{owner}: Secret {secret} does not exist")
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref and ("Secret", ref["name"]) not in have and ref["name"] not in EXTERNAL_SECRETS:
                problems.append(f"{owner}: Secret {ref['name']} does not exist")
    return problems


def check_env_expansion(objs: list[dict]) -> list[str]:
    """Every $(VAR) in args/command/env refers to a variable defined before it (Kubernetes
    would otherwise pass the text through literally)."""
    problems = []
    for owner, _, c in containers(objs):
        defined = set(LWS_INJECTED) if is_lws(owner) else set()
        for e in c.get("env", []):
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
                if var not in defined:
                    problems.append(f"{owner}/{c['name']}: env {e['name']} uses undefined {var}")
            defined.add(e["name"])
        for text in c.get("command", []) + c.get("args", []):
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
                if var not in defined:
                    problems.append(f"{owner}/{c['name']}: {text!r} uses undefined {var}")
    return problems


def check_security(objs: list[dict]) -> list[str]:
    problems = []
    for owner, tmpl, c in containers(objs):
        if not tmpl["spec"].get("securityContext", {}).get("runAsNonRoot"):
            problems.append(f"{owner}: pod securityContext.runAsNonRoot is not true")
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
            problems.append(f"{owner}/{c['name']}: privilege escalation not disabled")
    return problems


def check_images(objs: list[dict]) -> list[str]:
    """All megaserve containers of one render run the same image (an `images:` override
    that misses a workload, e.g. the LWS, shows up here)."""
    images = {c["image"] for _, _, c in containers(objs) if c.get("command") == ["megaserve"]}
    return [] if len(images) == 1 else [f"megaserve containers run several images: {images}"]


def check_loadbalancer_config(objs: list[dict]) -> list[str]:
    """The generated ConfigMap parses, has every key with the right type, and is what the
    router's --config points at."""
    cms = [
        o
        for o in objs
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("megaserve-loadbalancer")
    ]
    if len(cms) != 1:
        return [f"expected one megaserve-loadbalancer ConfigMap, found {len(cms)}"]
    cm = cms[0]
    problems = []
    cfg = yaml.safe_load(cm["data"]["loadbalancer.yaml"])
    for key, typ in LOADBALANCER_KEYS.items():
        if key not in cfg:
            problems.append(f"loadbalancer.yaml: no {key}")
        elif not isinstance(cfg[key], typ) or isinstance(cfg[key], bool):
            problems.append(f"loadbalancer.yaml: {key} is {cfg[key]!r}, not {typ.__name__}")
    for owner, tmpl, c in containers(objs):
        args = args_of(owner, c)
        if not is_server(c) or args[0] != "router":
            continue
        path = flag_value(args, "--config")
        vols = {v["name"]: v for v in tmpl["spec"].get("volumes", [])}
        ok = False
        for m in c.get("volumeMounts", []):
            v = vols.get(m["name"], {})
            if v.get("configMap", {}).get("name") == cm["metadata"]["name"]:
                ok = path in {f"{m['mountPath']}/{k}" for k in cm["data"]}
        if not ok:
            problems.append(f"{owner}: --config {path} is not the mounted loadbalancer.yaml")
    return problems


def check_model_names(objs: list[dict]) -> list[str]:
    """Every worker advertises (--served-model-name) a model the router serves
    (--checkpoint NAME=SPEC), loaded from the same checkpoint."""
    routers, workers = {}, []
    for owner, _, c in containers(objs):
        if not is_server(c):
            continue
        args = args_of(owner, c)
        if args[0] == "router":
            for i, a in enumerate(args):
                if a == "--checkpoint" and "=" in args[i + 1]:
                    name, spec = args[i + 1].split("=", 1)
                    routers[name] = spec
        else:
            workers.append((owner, flag_value(args, "--served-model-name"), args))
    problems = []
    for owner, name, args in workers:
        if name not in routers:
            problems.append(f"{owner}: serves {name!r}, the router knows {sorted(routers)}")
        elif routers[name] != flag_value(args, "--checkpoint"):
            problems.append(
                f"{owner}: {name} from {flag_value(args, '--checkpoint')}, "
                f"the router's from {routers[name]}"
            )
    return problems


def check_groups(objs: list[dict]) -> list[str]:
    """Every decode container of a LeaderWorkerSet joins its group: the JAX_* variables from
    the LWS ones, and --tp = size x the devices of one host (the mesh spans the group)."""
    problems = []
    for o in objs:
        if o["apiVersion"] != LWS_API:
            continue
        lwt = o["spec"]["leaderWorkerTemplate"]
        for role in ("leaderTemplate", "workerTemplate"):
            if role not in lwt:
                continue
            where = f"LeaderWorkerSet/{o['metadata']['name']}[{role}]"
            spec = lwt[role]["spec"]
            acc = spec.get("nodeSelector", {}).get("cloud.google.com/gke-tpu-accelerator")
            for c in spec["containers"]:
                if not is_server(c) or c["args"][0] != "decode-worker":
                    continue
                env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
                bad = {
                    k: env.get(k) for k, v in GROUP_ENV.items() if not env.get(k, "").startswith(v)
                }
                if bad:
                    problems.append(f"{where}/{c['name']}: group variables {bad}")
                per_host = TPU_CHIPS_PER_HOST.get(acc, 0) * TPU_DEVICES_PER_CHIP.get(acc, 0)
                want = str(lwt.get("size", 1) * per_host)
                tp = flag_value(args_of(where, c), "--tp")
                if per_host and tp != want:
                    problems.append(f"{where}/{c['name']}: --tp {tp}, the group has {want} devices")
    return problems


INVARIANTS = [
    check_groups,
    check_model_names,
    check_resources,
    check_probes,
    check_tpu,
    check_selectors,
    check_references,
    check_env_expansion,
    check_security,
    check_images,
    check_loadbalancer_config,
]


@pytest.mark.parametrize("check", INVARIANTS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("target", TARGETS)
def test_invariants(rendered, target, check):
    problems = check(rendered[target])
    assert not problems, "\n".join(problems)


def test_loadbalancer_config_loads_in_the_router():
    """deploy/base/loadbalancer.yaml is a config the router accepts (unknown keys refused)."""
    from router.config import RouterConfig

    cfg = RouterConfig.from_yaml(DEPLOY / "base" / "loadbalancer.yaml")
    mine = yaml.safe_load((DEPLOY / "base" / "loadbalancer.yaml").read_text())
    for key, value in mine.items():
        assert getattr(cfg, key) == value, key


def test_overlay_shapes(rendered):
    """What each overlay is for: counts, TPU placement, the multi-host decode group."""

    def by(objs, kind, name):
        return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)

    base = rendered["base"]
    assert by(base, "Deployment", "megaserve-router")["spec"]["replicas"] == 2
    assert {o["kind"] for o in base} >= {"Namespace", "ConfigMap", "PodDisruptionBudget"}
    assert not [c for _, _, c in containers(base) if "google.com/tpu" in str(c)]
    local = rendered["cpu-local"]
    for _, _, c in containers(local):
        assert "google.com/tpu" not in str(c)
        if is_server(c) and c["args"][0] != "router":
            assert flag_value(args_of("", c), "--checkpoint") == "smollm2"
    assert all(o["spec"]["replicas"] == 1 for o in local if o["kind"] == "Deployment"), (
        "cpu-local runs one pod per tier"
    )
    gke = rendered["gke-tpu7x"]
    assert not [o for o in gke if o["kind"] == "Deployment" and "decode" in o["metadata"]["name"]]
    lws = by(gke, "LeaderWorkerSet", "megaserve-decode-mh")
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    env = {
        e["name"]: e["value"]
        for e in lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0][
            "env"
        ]
        if "value" in e
    }
    assert env["JAX_COORDINATOR_ADDRESS"].startswith("$(LWS_LEADER_ADDRESS):")
    assert env["JAX_NUM_PROCESSES"] == "$(LWS_GROUP_SIZE)"
    assert env["JAX_PROCESS_ID"] == "$(LWS_WORKER_INDEX)"
    for owner, _tmpl, c in containers(gke):
        if is_server(c) and c["args"][0] != "router":
            assert any(m["mountPath"] == "/models" for m in c["volumeMounts"]), owner
            assert flag_value(args_of(owner, c), "--checkpoint").startswith("/models/")
    tls = rendered["gke-tpu7x-tls"]
    assert by(tls, "Service", "megaserve-router")["spec"]["type"] == "LoadBalancer"
    servers = [(o, c) for o, _, c in containers(tls) if is_server(c)]
    # router, prefill, and the decode group's leader and followers (they read the same flags)
    assert len(servers) == 4 and all(flag_value(c["args"], "--tls-cert") for _, c in servers)


def test_redis_persistence_and_sentinel(rendered):
    """Redis keeps an append-only file on a claimed volume; the Sentinel variant runs two of
    them and three Sentinels, and every server's --redis-url names those Sentinels."""
    from megaserve.redis_conn import parse_sentinel_url

    for target, objs in rendered.items():
        redis = find(objs, "StatefulSet", "megaserve-redis")
        args = first_container(redis)["args"]
        assert flag_value(args, "--appendonly") == "yes", target
        assert flag_value(args, "--dir") == "/data", target
        assert [t["metadata"]["name"] for t in redis["spec"]["volumeClaimTemplates"]] == ["data"]
        urls = {flag_value(args_of(o, c), "--redis-url") for o, _, c in containers(objs)}
        urls.discard(None)
        if "redis-sentinel" not in target:
            assert urls == {"redis://megaserve-redis:6379/0"}, target
            continue
        assert redis["spec"]["replicas"] == 2
        sentinels = find(objs, "StatefulSet", "megaserve-redis-sentinel")
        assert sentinels["spec"]["replicas"] == 3
        assert not [
            o for o in objs if o["metadata"]["name"] == "megaserve-redis" and o["kind"] == "Service"
        ]
        (url,) = urls
        u = parse_sentinel_url(url)
        service = sentinels["spec"]["serviceName"]
        assert u.service == "megaserve" and u.sentinels == tuple(
            (f"megaserve-redis-sentinel-{i}.{service}", 26379) for i in range(3)
        ), url
        (scripts,) = [
            o["data"] for o in objs if o["metadata"]["name"].startswith("megaserve-redis-scripts")
        ]
        assert f"sentinel monitor {u.service} " in scripts["sentinel.sh"]


# --- the command lines against megaserve's argparse --------------------------------------


@pytest.fixture(scope="module")
def cli_commands() -> dict[str, argparse.ArgumentParser]:
    """The subcommand parsers `megaserve_app.cli.main` builds (captured at its parse_args)."""
    from megaserve_app import cli

    class Captured(Exception):
        pass

    holder = {}

    def capture(self, args=None, namespace=None):
        holder["parser"] = self
        raise Captured

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        with contextlib.suppress(Captured):
            cli.main(["--help"])
    sub = next(a for a in holder["parser"]._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def check_flags(objs: list[dict], commands: dict) -> tuple[list[str], set[str]]:
    """(problems, pending): each server's args parse with its subcommand's parser; pending
    are the commands/flags of PENDING_* that the CLI does not have yet."""
    problems, pending = [], set()
    for owner, _, c in containers(objs):
        if not is_server(c):
            continue
        cmd, *args = args_of(owner, c)
        if cmd not in commands:
            if cmd in PENDING_COMMANDS:
                pending.add(cmd)
            else:
                problems.append(f"{owner}: megaserve has no command {cmd!r}")
            continue
        parser = commands[cmd]
        kept = []
        skip = False
        for a in args:
            if skip:
                skip = False
                continue
            flag = a.split("=", 1)[0]
            if flag in PENDING_FLAGS and flag not in parser._option_string_actions:
                pending.add(f"{cmd} {flag}")
                skip = "=" not in a
                continue
            kept.append(a)
        for a in kept:  # argparse would accept an abbreviation; a manifest should not use one
            flag = a.split("=", 1)[0]
            if flag.startswith("--") and flag not in parser._option_string_actions:
                problems.append(f"{owner}/{c['name']}: megaserve {cmd} has no flag {flag}")
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(kept)
        except SystemExit:
            problems.append(
                f"{owner}/{c['name']}: megaserve {cmd} rejects {kept}: {err.getvalue()}"
            )
    return problems, pending


@pytest.mark.parametrize("target", TARGETS)
def test_command_lines_parse(rendered, cli_commands, target):
    problems, _ = check_flags(rendered[target], cli_commands)
    assert not problems, "\n".join(problems)


def test_cli_catches_up(rendered, cli_commands):
    """Every command and flag the manifests use exists in megaserve's CLI."""
    pending = set()
    for objs in rendered.values():
        pending |= check_flags(objs, cli_commands)[1]
    assert not pending, f"not in megaserve's CLI yet: {sorted(pending)}"


# --- negative tests: real mistakes must fail ---------------------------------------------


def find(objs, kind, name):
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)


def first_container(o: dict) -> dict:
    if o["apiVersion"] == LWS_API:
        return o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    return o["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "corrupt",
    [
        # a typo in a field name
        lambda o: first_container(o)["ports"][0].update(containerPrt=1),
        lambda o: o["spec"]["template"]["spec"].update(nodeSelectr={}),
        lambda o: first_container(o).update(readinesProbe={"grpc": {"port": 50061}}),
        # a wrong type / value
        lambda o: o["spec"].update(replicas="two"),
        lambda o: first_container(o)["readinessProbe"]["grpc"].update(port="grpc"),
        lambda o: first_container(o)["env"].append({"value": "x"}),
        lambda o: first_container(o)["ports"][0].update(containerPort="50061"),
    ],
    ids=[
        "containerPrt",
        "nodeSelectr",
        "readinesProbe",
        "replicas-str",
        "grpc-named-port",
        "env-without-name",
        "port-as-string",
    ],
)
def test_schema_rejects_mistakes(rendered, corrupt):
    o = copy.deepcopy(find(rendered["base"], "Deployment", "megaserve-decode"))
    assert validate_object(o) == []
    corrupt(o)
    assert validate_object(o), "the corrupted manifest validated"


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda o: o["spec"]["leaderWorkerTemplate"].update(sise=2),
        lambda o: o["spec"]["leaderWorkerTemplate"].update(restartPolicy="Sometimes"),
        lambda o: o["spec"].update(startupPolicy="Eventually"),
        lambda o: o["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"].update(
            nodeSelectr={}
        ),
        lambda o: first_container(o)["env"].append({"name": "X", "valu": "1"}),
        lambda o: o["spec"]["leaderWorkerTemplate"].pop("workerTemplate"),
    ],
    ids=["sise", "restartPolicy", "startupPolicy", "template-typo", "env-typo", "no-template"],
)
def test_lws_schema_rejects_mistakes(rendered, corrupt):
    o = copy.deepcopy(find(rendered["gke-tpu7x"], "LeaderWorkerSet", "megaserve-decode-mh"))
    assert validate_object(o) == []
    corrupt(o)
    assert validate_object(o), "the corrupted LeaderWorkerSet validated"


def _set_arg(c: dict, flag: str, value: str) -> None:
    c["args"][c["args"].index(flag) + 1] = value


def _set_env(c: dict, name: str, value: str) -> None:
    next(e for e in c["env"] if e["name"] == name)["value"] = value


@pytest.mark.parametrize(
    "check, target, kind, name, corrupt",
    [
        (
            check_probes,
            "base",
            "Deployment",
            "megaserve-decode",
            lambda o: _set_arg(first_container(o), "--port", "50062"),
        ),
        (
            check_probes,
            "base",
            "Deployment",
            "megaserve-router",
            lambda o: first_container(o)["livenessProbe"]["tcpSocket"].update(port=9090),
        ),
        (
            check_probes,
            "base+tls",
            "Deployment",
            "megaserve-prefill",
            lambda o: first_container(o).update(readinessProbe={"grpc": {"port": 50071}}),
        ),
        (
            check_tpu,
            "gke-tpu7x",
            "Deployment",
            "megaserve-prefill",
            lambda o: first_container(o)["resources"]["requests"].update({"google.com/tpu": "2"}),
        ),
        (
            check_tpu,
            "gke-tpu7x",
            "LeaderWorkerSet",
            "megaserve-decode-mh",
            lambda o: o["spec"]["leaderWorkerTemplate"].update(size=3),
        ),
        (
            check_groups,
            "gke-tpu7x",
            "LeaderWorkerSet",
            "megaserve-decode-mh",
            lambda o: _set_arg(first_container(o), "--tp", "8"),
        ),
        (
            check_groups,
            "gke-tpu7x+redis-sentinel",
            "LeaderWorkerSet",
            "megaserve-decode-mh",
            lambda o: _set_env(
                o["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0],
                "JAX_PROCESS_ID",
                "0",
            ),
        ),
        (
            check_probes,
            "gke-tpu7x-tls",
            "LeaderWorkerSet",
            "megaserve-decode-mh",
            lambda o: first_container(o).update(readinessProbe={"tcpSocket": {"port": 50061}}),
        ),
        (
            check_selectors,
            "base",
            "PodDisruptionBudget",
            "megaserve-decode",
            lambda o: o["spec"]["selector"]["matchLabels"].update(
                {"app.kubernetes.io/component": "decoder"}
            ),
        ),
        (
            check_selectors,
            "base",
            "Service",
            "megaserve-prefill",
            lambda o: o["spec"]["ports"][0].update(targetPort="gprc"),
        ),
        (
            check_env_expansion,
            "base",
            "Deployment",
            "megaserve-decode",
            lambda o: _set_arg(first_container(o), "--host", "$(POD_ADDR)"),
        ),
        (
            check_references,
            "gke-tpu7x",
            "Deployment",
            "megaserve-prefill",
            lambda o: o["spec"]["template"]["spec"].update(serviceAccountName="nobody"),
        ),
        (
            check_loadbalancer_config,
            "base",
            "Deployment",
            "megaserve-router",
            lambda o: _set_arg(first_container(o), "--config", "/etc/megaserve/lb.yaml"),
        ),
    ],
    ids=[
        "port-flag",
        "probe-port",
        "grpc-probe-under-tls",
        "tpu-request",
        "lws-size",
        "group-tp",
        "group-process-id",
        "follower-probe",
        "pdb-selector",
        "service-targetport",
        "env-undefined",
        "serviceaccount",
        "config-path",
    ],
)
def test_invariants_catch_mistakes(rendered, check, target, kind, name, corrupt):
    objs = copy.deepcopy(rendered[target])
    assert check(objs) == []
    corrupt(find(objs, kind, name))
    assert check(objs), "the broken manifest passed"


def test_loadbalancer_config_missing_key(rendered):
    objs = copy.deepcopy(rendered["base"])
    cm = next(o for o in objs if o["kind"] == "ConfigMap")
    cm["data"]["loadbalancer.yaml"] = cm["data"]["loadbalancer.yaml"].replace(
        "session_ttl_s", "session_ttl"
    )
    assert any("session_ttl_s" in p for p in check_loadbalancer_config(objs))


def test_flags_catch_mistakes(rendered, cli_commands):
    objs = copy.deepcopy(rendered["base"])
    c = first_container(find(objs, "Deployment", "megaserve-decode"))
    c["args"][c["args"].index("--kv-budget-mb")] = "--kv-budget"  # an abbreviation
    problems, _ = check_flags(objs, cli_commands)
    assert any("decode-worker has no flag --kv-budget" in p for p in problems)
    objs = copy.deepcopy(rendered["base"])
    c = first_container(find(objs, "Deployment", "megaserve-decode"))
    c["args"][c["args"].index("--kv-budget-mb")] = "--kv-budgt-mb"  # a typo
    assert check_flags(objs, cli_commands)[0]
    objs = copy.deepcopy(rendered["base"])
    _set_arg(first_container(find(objs, "Deployment", "megaserve-prefill")), "--port", "x")
    assert check_flags(objs, cli_commands)[0]


# --- the renderer ------------------------------------------------------------------------


def test_renderer_refuses_what_it_does_not_implement(tmp_path):
    with pytest.raises(render.RenderError, match="unsupported"):
        render.render_kustomization({"resources": [], "replicas": []}, tmp_path)
    with pytest.raises(render.RenderError, match="includeSelectors"):
        render.render_kustomization(
            {"resources": ["../base"], "labels": [{"pairs": {"a": "b"}, "includeSelectors": True}]},
            OVERLAYS,
        )
    lws_smp = {
        "patches": [
            {
                "patch": "kind: LeaderWorkerSet\napiVersion: leaderworkerset.x-k8s.io/v1\n"
                "metadata: {name: megaserve-decode-mh}\nspec: {replicas: 2}"
            }
        ],
        "resources": ["gke-tpu7x"],
    }
    with pytest.raises(render.RenderError, match="JSON6902"):
        render.render_kustomization(lws_smp, OVERLAYS)


def test_renderer_patch_semantics():
    base = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d"},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "a",
                            "args": ["x", "y"],
                            "env": [{"name": "E", "value": "1"}],
                            "readinessProbe": {"grpc": {"port": 1}},
                        },
                        {"name": "b", "image": "i"},
                    ]
                }
            }
        },
    }
    patch = {
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "a",
                            "args": ["z"],
                            "env": [{"name": "F", "value": "2"}],
                            "readinessProbe": {"grpc": None, "tcpSocket": {"port": 1}},
                        }
                    ]
                }
            }
        }
    }
    out = render.strategic_merge(base, patch)
    a, b = out["spec"]["template"]["spec"]["containers"]
    assert a["args"] == ["z"]  # no merge key: replaced
    assert [e["name"] for e in a["env"]] == ["F", "E"]  # merged by name, patch items first
    assert a["readinessProbe"] == {"tcpSocket": {"port": 1}}  # null deletes
    assert b == {"name": "b", "image": "i"}
    o = copy.deepcopy(base)
    render.apply_json6902(
        o,
        [
            {"op": "test", "path": "/spec/template/spec/containers/0/name", "value": "a"},
            {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "w"},
            {"op": "remove", "path": "/spec/template/spec/containers/1"},
            {"op": "replace", "path": "/metadata/name", "value": "e"},
        ],
    )
    assert o["metadata"]["name"] == "e"
    assert o["spec"]["template"]["spec"]["containers"][0]["args"] == ["x", "y", "w"]
    assert len(o["spec"]["template"]["spec"]["containers"]) == 1
    with pytest.raises(render.RenderError, match="test failed"):
        render.apply_json6902(o, [{"op": "test", "path": "/metadata/name", "value": "d"}])


@pytest.mark.parametrize("target", TARGETS)
def test_renderer_matches_kustomize(rendered, target, tmp_path):
    """Wherever kubectl (with its built-in kustomize) is on PATH, it renders the same objects
    (same generated ConfigMap names included): a difference, or a kubectl that cannot render,
    fails. Only a machine without kubectl skips (the README's set-up does not install it)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH")
    t = TARGETS[target]
    if isinstance(t, dict):
        rel = os.path.relpath(OVERLAYS, tmp_path)
        k = {key: [f"{rel}/{p}" for p in v] for key, v in t.items()}
        (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(k))
        t = tmp_path
    out = subprocess.run(
        [kubectl, "kustomize", str(t)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"{kubectl} kustomize {t} failed:\n{out.stderr}"

    def key(o):
        return (o["apiVersion"], o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])

    theirs = {key(o): o for o in yaml.safe_load_all(out.stdout) if o}
    mine = {key(o): o for o in rendered[target]}
    assert mine, f"nothing rendered for {target}"
    assert sorted(mine) == sorted(theirs)
    diffs = [_first_difference(mine[k], theirs[k], "/".join(map(str, k))) for k in mine]
    assert not [d for d in diffs if d], [d for d in diffs if d]


def _first_difference(a, b, path: str) -> str:
    """'' if equal, else where the first difference is and both values there."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys(), key=str):
            if k not in a or k not in b:
                return f"{path}.{k}: render.py {a.get(k)!r} vs kustomize {b.get(k)!r}"
            d = _first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return ""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return ""
    return "" if a == b else f"{path}: render.py {a!r} vs kustomize {b!r}"


def test_kustomize_comparison_names_a_difference(rendered):
    """The comparison above fails on any changed, added or dropped field, and says where."""
    o = copy.deepcopy(find(rendered["base"], "Deployment", "megaserve-router"))
    assert _first_difference(o, copy.deepcopy(o), "x") == ""
    changed = copy.deepcopy(o)
    changed["spec"]["replicas"] += 1
    assert _first_difference(o, changed, "x") == (
        f"x.spec.replicas: render.py {o['spec']['replicas']} vs kustomize "
        f"{o['spec']['replicas'] + 1}"
    )
    dropped = copy.deepcopy(o)
    del dropped["metadata"]["name"]
    assert _first_difference(o, dropped, "x").startswith("x.metadata.name: ")
    extra = copy.deepcopy(o)
    extra["spec"]["template"]["spec"]["containers"].append({"name": "extra"})
    assert "containers" in _first_difference(o, extra, "x")
