"""``pskv launch --launcher yarn``: a YARN service spec for the job, written (``--output``,
``--dry-run``) or submitted with ``yarn app -launch NAME FILE`` (docs/launchers/yarn.md)."""

from __future__ import annotations

import json
import shlex
import subprocess
import tempfile
from typing import Any, Optional

from .job import Document, run_quiet
from .spec import JobSpec

SCHEDULER_DNS = "scheduler-0.${SERVICE_NAME}.${USER}.${DOMAIN}"
RANK_VAR = "PSKV_RANK"


def yarn_service(spec: JobSpec) -> dict[str, Any]:
    """The service spec as a JSON-ready dict."""
    artifact = {"artifact": {"id": spec.image, "type": "DOCKER"}} if spec.image else {}
    sized = {"cpus": spec.cpus if spec.cpus is not None else 1, "memory": str(spec.memory_mb if spec.memory_mb is not None else 2048)}

    def component(name: str, count: int, argv: list[str], env: dict[str, str], resource: dict[str, Any]) -> dict[str, Any]:
        env.update(spec.secret_env())  # the spec is a private file; YARN shows it to the service's owner and admins
        comp = {"name": name, "number_of_containers": count, "restart_policy": "NEVER", **artifact}
        comp.update(launch_command=shlex.join(argv), resource=resource, configuration={"env": env})
        return comp if name == "scheduler" else {**comp, "dependencies": ["scheduler"]}

    components = []
    if spec.num_servers:
        env = {**spec.process_env("scheduler", SCHEDULER_DNS, spec.port), "DMLC_PS_ROOT_URI": "0.0.0.0"}
        components.append(component("scheduler", 1, spec.argv("server"), env, {"cpus": 1, "memory": "1024"}))
    for role in spec.roles():
        env = {**spec.process_env(role, SCHEDULER_DNS, spec.port), RANK_VAR: "${COMPONENT_ID}"}
        components.append(component(role, spec.count(role), spec.guarded(role, "--rank-from", RANK_VAR), env, sized))
    service: dict[str, Any] = {"name": spec.name, "version": "1.0.0", "components": components}
    if spec.timeout is not None:
        service["lifetime"] = str(int(spec.timeout))
    return service


class Yarn(Document):
    launcher = tool = "yarn"
    hint = "pass --output FILE to write the service spec instead, or --dry-run to see it"

    def __init__(self, spec: JobSpec):
        super().__init__(spec)
        name = spec.name
        self.text = json.dumps(yarn_service(spec), indent=2) + "\n"
        self.command = ["yarn", "app", "-launch", name, spec.output or "SPEC.json", *spec.launcher_args]
        self.title = f"YARN service spec ({name})"
        self.written = f"wrote the YARN service spec to {spec.output}; submit it with: {shlex.join(self.command)}"
        self.success = f"launched YARN service {name}; follow it with `yarn app -status {name}`, stop it with `yarn app -destroy {name}`"

    def plan(self, port: Optional[int]) -> str:
        return f"{super().plan(port)}# submit\n{shlex.join(self.command)}"

    def submit(self) -> subprocess.CompletedProcess[str]:
        with tempfile.NamedTemporaryFile("w", prefix=f"{self.spec.name}-", suffix=".json") as f:
            f.write(self.text)
            f.flush()
            return run_quiet([self.tool, *self.command[1:4], f.name, *self.command[5:]], timeout=600)
