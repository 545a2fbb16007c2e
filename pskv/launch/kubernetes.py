"""``pskv launch --launcher kubernetes``: manifests for the job, written to a file or applied.

Objects (``NAME`` is ``--job-name``; all labelled ``pskv/job: NAME`` and ``pskv/role: ROLE``):

* ``Service NAME-scheduler``: the scheduler's stable address, port ``--port`` (9091);
* ``Job NAME-scheduler``: one pod, ``python3 -m pskv serve``, bound to its own pod IP
  (``DMLC_PS_ROOT_URI`` from the downward API ``status.podIP``);
* ``Job NAME-server`` and ``Job NAME-worker``: Indexed Jobs of S and W pods running
  ``python3 -m pskv.launch.guard --rank-from JOB_COMPLETION_INDEX -- COMMAND``, with
  ``DMLC_PS_ROOT_URI=NAME-scheduler`` (the Service, same namespace) and ``DMLC_NODE_HOST`` = the
  pod's IP, so servers and workers reach each other pod to pod.

Every pod has ``restartPolicy: Never`` and every Job ``backoffLimit: 0``: a failed pod fails its
Job, which stops the Job's other pods, and the rest of the job fails within
``PSKV_HEARTBEAT_TIMEOUT``. ``--timeout`` becomes ``activeDeadlineSeconds``. The image
(``--image``, required) must hold ``--python`` (default ``python3``) with pskv, and the program.

``--output FILE`` writes them (JSON ``kind: List``; YAML documents for ``.yaml``/``.yml``);
``--dry-run`` prints them; otherwise ``kubectl apply -f -`` applies them.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from typing import Any, Optional

from ..errors import LaunchError
from .common import JobSpec, base_env, guard_argv, print_plan, require_tool, role_env

RANK_VAR = "JOB_COMPLETION_INDEX"
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _env_list(env: dict[str, str], pod_ip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in env.items() if k not in pod_ip]
    out += [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} for k in pod_ip]
    return out


def manifests(spec: JobSpec) -> list[dict[str, Any]]:
    """The Service and Jobs of the job, as JSON-ready dicts."""
    if not spec.image:
        raise LaunchError("the kubernetes launcher needs --image IMAGE (with python and pskv in it)")
    name = spec.name
    if not _DNS_LABEL.fullmatch(name) or len(name) > 52:
        raise LaunchError(
            f"--job-name {name!r}: Kubernetes names are lower-case letters, digits and '-', "
            "at most 52 characters here (the objects add '-scheduler')"
        )
    scheduler = f"{name}-scheduler"
    base = base_env(spec, scheduler, spec.port)

    def labels(role: str) -> dict[str, str]:
        return {"app.kubernetes.io/name": "pskv", "pskv/job": name, "pskv/role": role}

    def resources() -> dict[str, Any]:
        req: dict[str, str] = {}
        if spec.cpus is not None:
            req["cpu"] = f"{spec.cpus:g}"
        if spec.memory_mb is not None:
            req["memory"] = f"{spec.memory_mb}Mi"
        return {"resources": {"requests": req, "limits": {"memory": req["memory"]} if "memory" in req else {}}} if req else {}

    def job(role: str, count: int, container: dict[str, Any], indexed: bool) -> dict[str, Any]:
        job_spec: dict[str, Any] = {"completions": count, "parallelism": count, "backoffLimit": 0}
        if indexed:
            job_spec["completionMode"] = "Indexed"
        if spec.timeout is not None:
            job_spec["activeDeadlineSeconds"] = int(spec.timeout)
        job_spec["template"] = {
            "metadata": {"labels": labels(role)},
            "spec": {"restartPolicy": "Never", "containers": [container]},
        }
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{name}-{role}", "labels": labels(role)},
            "spec": job_spec,
        }

    items: list[dict[str, Any]] = []
    if spec.num_servers:
        items.append(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": scheduler, "labels": labels("scheduler")},
                "spec": {
                    "selector": {"pskv/job": name, "pskv/role": "scheduler"},
                    "ports": [{"name": "scheduler", "port": spec.port, "targetPort": spec.port}],
                },
            }
        )
        env = role_env(spec, base, "scheduler")
        container = {
            "name": "scheduler",
            "image": spec.image,
            "command": spec.serve_argv(),
            "env": _env_list(env, pod_ip=("DMLC_PS_ROOT_URI",)),
            "ports": [{"containerPort": spec.port, "name": "scheduler"}],
        }
        items.append(job("scheduler", 1, container, indexed=False))
    for role in ("server", "worker"):
        n = spec.count(role)
        if not n:
            continue
        env = role_env(spec, base, role)
        if role == "worker":
            env.update({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
        cmd = spec.serve_argv() if role == "server" else spec.worker_argv()
        container = {
            "name": role,
            "image": spec.image,
            "command": [*guard_argv(spec.python, rank_from=[RANK_VAR]), "--", *cmd],
            "env": _env_list(env, pod_ip=("DMLC_NODE_HOST",)),
            **resources(),
        }
        items.append(job(role, n, container, indexed=True))
    return items


# --------------------------------------------------------------------------------------------
# YAML (block style; strings always double-quoted, which is JSON's syntax and valid YAML)

_PLAIN_KEY = re.compile(r"[A-Za-z0-9_./-]+")


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    return json.dumps(str(value))


def _key(key: str) -> str:
    return key if _PLAIN_KEY.fullmatch(key) else json.dumps(key)


def to_yaml(value: Any, indent: int = 0) -> str:
    """``value`` (dicts, lists, scalars) as block-style YAML."""
    pad = " " * indent
    if isinstance(value, dict):
        if not value:
            return pad + "{}\n"
        out = []
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                out.append(f"{pad}{_key(k)}:\n{to_yaml(v, indent + 2)}")
            else:
                out.append(f"{pad}{_key(k)}: {_empty_or_scalar(v)}\n")
        return "".join(out)
    if isinstance(value, list):
        if not value:
            return pad + "[]\n"
        out = []
        for item in value:
            if isinstance(item, (dict, list)) and item:
                body = to_yaml(item, indent + 2)
                out.append(f"{pad}- {body[indent + 2 :]}")
            else:
                out.append(f"{pad}- {_empty_or_scalar(item)}\n")
        return "".join(out)
    return pad + _scalar(value) + "\n"


def _empty_or_scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return _scalar(value)


def render(items: list[dict[str, Any]], fmt: str) -> str:
    if fmt == "yaml":
        return "".join(f"---\n{to_yaml(item)}" for item in items)
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2) + "\n"


def output_format(path: Optional[str]) -> str:
    return "yaml" if path and path.lower().endswith((".yaml", ".yml")) else "json"


def launch_kubernetes(spec: JobSpec) -> int:
    """Write, print or apply the manifests; the exit status."""
    items = manifests(spec)
    follow = (
        f"follow it with `kubectl logs -f -l pskv/job={spec.name} --prefix --max-log-requests {spec.num_workers + spec.num_servers + 1}`; "
        f"remove it with `kubectl delete job,service -l pskv/job={spec.name}`"
    )
    if spec.output:
        with open(spec.output, "w") as f:
            f.write(render(items, output_format(spec.output)))
        print(f"pskv launch: wrote {len(items)} Kubernetes objects to {spec.output}; apply them with `kubectl apply -f {spec.output}`", file=sys.stderr)
        return 0
    if spec.dry_run:
        print_plan(f"Kubernetes objects of job {spec.name} (kubectl apply -f -)", render(items, "yaml"))
        return 0
    kubectl = require_tool("kubectl", "kubernetes", "pass --output FILE to write the manifests instead")
    argv = [kubectl, "apply", "-f", "-", *spec.launcher_args]
    try:
        res = subprocess.run(argv, input=render(items, "json"), capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`{shlex.join(argv)}` did not finish within 300 s") from None
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.returncode == 0:
        print(f"pskv launch: applied job {spec.name}; {follow}", file=sys.stderr)
    else:
        print(f"pskv launch: `{shlex.join(argv)}` failed with status {res.returncode}", file=sys.stderr)
    return res.returncode
