"""``pskv launch --launcher kubernetes``: a Service and Jobs for the job, written (``--output``,
``--dry-run``) or applied with ``kubectl apply -f -`` (docs/launchers/kubernetes.md)."""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import LaunchError
from .job import Document
from .spec import JobSpec

RANK_VAR = "JOB_COMPLETION_INDEX"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
ONE_PER_POD = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}


def manifests(spec: JobSpec) -> list[dict[str, Any]]:
    """The Service and Jobs of the job, as JSON-ready dicts."""
    if not spec.image:
        raise LaunchError("the kubernetes launcher needs --image IMAGE (with python and pskv in it)")
    name = spec.name
    if not _DNS_LABEL.fullmatch(name) or len(name) > 52:
        rule = "Kubernetes names are lower-case letters, digits and '-', at most 52 characters here"
        raise LaunchError(f"--job-name {name!r}: {rule} (the objects add '-scheduler')")
    scheduler = f"{name}-scheduler"
    requests = {"cpu": f"{spec.cpus:g}"} if spec.cpus is not None else {}
    limits = {"memory": f"{spec.memory_mb}Mi"} if spec.memory_mb is not None else {}
    resources = {"resources": {"requests": {**requests, **limits}, "limits": limits}} if requests or limits else {}

    labels = {"app.kubernetes.io/name": "pskv", "pskv/job": name}

    def meta(role: str) -> dict[str, Any]:
        return {"name": f"{name}-{role}", "labels": {**labels, "pskv/role": role}}

    def env_list(env: dict[str, str], pod_ip: str) -> list[dict[str, Any]]:
        """A container's ``env``, with variable ``pod_ip`` set to the pod's IP (downward API) and
        ``PSKV_SECRET`` from the job's Kubernetes Secret."""
        out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items() if k != pod_ip]
        out.append({"name": "PSKV_SECRET", "valueFrom": {"secretKeyRef": {"name": meta("secret")["name"], "key": "PSKV_SECRET"}}})
        return [*out, {"name": pod_ip, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]

    def job(role: str, count: int, container: dict[str, Any]) -> dict[str, Any]:
        body: dict[str, Any] = {"completions": count, "parallelism": count, "backoffLimit": 0}
        if role != "scheduler":
            body["completionMode"] = "Indexed"  # JOB_COMPLETION_INDEX: the rank
        if spec.timeout is not None:
            body["activeDeadlineSeconds"] = int(spec.timeout)
        pod = {"restartPolicy": "Never", "containers": [{"name": role, "image": spec.image, **container}]}
        body["template"] = {"metadata": {"labels": meta(role)["labels"]}, "spec": pod}
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta(role), "spec": body}

    secret = {"PSKV_SECRET": spec.secret or ""}
    items: list[dict[str, Any]] = [{"apiVersion": "v1", "kind": "Secret", "metadata": meta("secret"), "type": "Opaque", "stringData": secret}]
    if spec.num_servers:
        ports = [{"name": "scheduler", "port": spec.port, "targetPort": spec.port}]
        service = {"selector": {"pskv/job": name, "pskv/role": "scheduler"}, "ports": ports}
        items.append({"apiVersion": "v1", "kind": "Service", "metadata": meta("scheduler"), "spec": service})
        env = env_list(spec.process_env("scheduler", scheduler, spec.port), "DMLC_PS_ROOT_URI")
        port = [{"containerPort": spec.port, "name": "scheduler"}]
        items.append(job("scheduler", 1, {"command": spec.argv("server"), "env": env, "ports": port}))
    for role in spec.roles():
        env = env_list(spec.process_env(role, scheduler, spec.port, torch=ONE_PER_POD), "DMLC_NODE_HOST")
        command = spec.guarded(role, "--rank-from", RANK_VAR)
        items.append(job(role, spec.count(role), {"command": command, "env": env, **resources}))
    return items


class Kubernetes(Document):
    launcher, tool = "kubernetes", "kubectl"
    hint = "pass --output FILE to write the manifests instead"

    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        items, name = manifests(spec), spec.name
        self.text = json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2) + "\n"
        self.command = ["kubectl", "apply", "-f", "-", *spec.launcher_args]
        self.title = f"Kubernetes objects of job {name} (kubectl apply -f -)"
        self.written = f"wrote {len(items)} Kubernetes objects to {spec.output}; apply them with `kubectl apply -f {spec.output}`"
        logs = f"kubectl logs -f -l pskv/job={name} --prefix --max-log-requests {spec.num_workers + spec.num_servers + 1}"
        self.success = f"applied job {name}; follow it with `{logs}`; remove it with `kubectl delete job,service,secret -l pskv/job={name}`"
