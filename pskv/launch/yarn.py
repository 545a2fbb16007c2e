"""``pskv launch --launcher yarn``: a YARN service (Hadoop 3 "Yarnfile") for the job.

Three components, each container running one process:

=========== ============ ==============================================================
component   containers   launch command
=========== ============ ==============================================================
scheduler   1            ``python3 -m pskv serve``, listening on ``--port`` (9091)
server      S            ``python3 -m pskv.launch.guard --rank-from PSKV_RANK -- python3 -m pskv serve``
worker      W            ``python3 -m pskv.launch.guard --rank-from PSKV_RANK -- COMMAND``
=========== ============ ==============================================================

Servers and workers find the scheduler by its registry DNS name,
``scheduler-0.${SERVICE_NAME}.${USER}.${DOMAIN}`` (YARN fills the ``${...}`` in; the cluster needs
registry DNS), and take their rank from ``PSKV_RANK=${COMPONENT_ID}``, the instance number YARN
gives each container. The scheduler binds 0.0.0.0 in its container. Every component has
``restart_policy: NEVER`` (a restarted node could not rejoin the job), and servers and workers
depend on the scheduler. ``--image`` makes them Docker containers; ``--cpus``/``--memory`` size
the servers' and workers' containers.

``--output FILE`` or ``--dry-run`` write the spec; otherwise it is submitted with
``yarn app -launch NAME FILE``, which needs the ``yarn`` command here.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from typing import Any

from .common import (
    JobSpec,
    base_env,
    guard_argv,
    print_plan,
    require_tool,
    role_env,
    run_quiet,
)

SCHEDULER_DNS = "scheduler-0.${SERVICE_NAME}.${USER}.${DOMAIN}"
RANK_VAR = "PSKV_RANK"


def yarn_service(spec: JobSpec) -> dict[str, Any]:
    """The service spec as a JSON-ready dict."""
    cpus = spec.cpus if spec.cpus is not None else 1
    memory = str(spec.memory_mb if spec.memory_mb is not None else 2048)
    artifact = {"artifact": {"id": spec.image, "type": "DOCKER"}} if spec.image else {}

    def component(name: str, count: int, argv: list[str], env: dict[str, str], resource: dict[str, Any]) -> dict[str, Any]:
        comp: dict[str, Any] = {
            "name": name,
            "number_of_containers": count,
            "restart_policy": "NEVER",
            **artifact,
            "launch_command": shlex.join(argv),
            "resource": resource,
            "configuration": {"env": env},
        }
        if name != "scheduler":
            comp["dependencies"] = ["scheduler"]
        return comp

    base = base_env(spec, SCHEDULER_DNS, spec.port)
    components = []
    if spec.num_servers:
        sched_env = {**role_env(spec, base, "scheduler"), "DMLC_PS_ROOT_URI": "0.0.0.0"}
        components.append(component("scheduler", 1, spec.serve_argv(), sched_env, {"cpus": 1, "memory": "1024"}))
    for role in ("server", "worker"):
        n = spec.count(role)
        if not n:
            continue
        env = {**role_env(spec, base, role), RANK_VAR: "${COMPONENT_ID}"}
        cmd = spec.serve_argv() if role == "server" else spec.worker_argv()
        argv = [*guard_argv(spec.python, rank_from=[RANK_VAR]), "--", *cmd]
        components.append(component(role, n, argv, env, {"cpus": cpus, "memory": memory}))
    service: dict[str, Any] = {"name": spec.name, "version": "1.0.0", "components": components}
    if spec.timeout is not None:
        service["lifetime"] = str(int(spec.timeout))
    return service


def launch_yarn(spec: JobSpec) -> int:
    """Write or submit the YARN service; the exit status."""
    text = json.dumps(yarn_service(spec), indent=2) + "\n"
    submit = ["yarn", "app", "-launch", spec.name, spec.output or "SPEC.json", *spec.launcher_args]
    if spec.output:
        with open(spec.output, "w") as f:
            f.write(text)
        print(f"pskv launch: wrote the YARN service spec to {spec.output}; submit it with: {shlex.join(submit)}", file=sys.stderr)
        return 0
    if spec.dry_run:
        print_plan(f"YARN service spec ({spec.name})", text)
        print_plan("submit", shlex.join(submit))
        return 0
    yarn = require_tool("yarn", "yarn", "pass --output FILE to write the service spec instead, or --dry-run to see it")
    fd, path = tempfile.mkstemp(prefix=f"{spec.name}-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        res = run_quiet([yarn, "app", "-launch", spec.name, path, *spec.launcher_args], timeout=600)
    finally:
        os.unlink(path)
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.returncode == 0:
        print(
            f"pskv launch: launched YARN service {spec.name}; follow it with `yarn app -status {spec.name}`, "
            f"stop it with `yarn app -destroy {spec.name}`",
            file=sys.stderr,
        )
    return res.returncode
