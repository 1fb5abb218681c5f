"""Small Harbor-layout tasks written to a temporary directory, for service and backend tests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sandbox_service.contracts import EnvironmentSpec, Task, TaskLayout, TaskLimits

# A verifier that needs nothing but bash: it checks /app/hello.txt and writes Harbor's reward file
# plus a CTRF record with one entry per assertion.
CHECK_HELLO = r"""#!/bin/bash
mkdir -p /logs/verifier
exists=failed; content=failed
[ -f /app/hello.txt ] && exists=passed
[ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ] && content=passed
cat >/logs/verifier/ctrf.json <<EOF
{"results": {"tool": {"name": "bash"}, "summary": {}, "tests": [
  {"name": "test_file_exists", "status": "$exists"},
  {"name": "test_file_content", "status": "$content"}]}}
EOF
reward=0
if [ $exists = passed ] && [ $content = passed ]; then reward=1; fi
echo $reward >/logs/verifier/reward.txt
"""


def write_hello_task(
    root: Path,
    *,
    name: str = "hello",
    docker_image: str | None = "ubuntu:24.04",
    limits: TaskLimits | None = None,
    allow_internet: bool = False,
    env: dict[str, str] | None = None,
    test_script: str = CHECK_HELLO,
) -> Task:
    task_dir = root / name
    (task_dir / "tests").mkdir(parents=True)
    (task_dir / "solution").mkdir()
    (task_dir / "environment").mkdir()
    (task_dir / "instruction.md").write_text('Create /app/hello.txt containing "Hello, world!".\n')
    (task_dir / "tests" / "test.sh").write_text(test_script)
    (task_dir / "tests" / "test.sh").chmod(0o755)
    (task_dir / "solution" / "solve.sh").write_text("#!/bin/bash\nprintf 'Hello, world!' > /app/hello.txt\n")
    dockerfile = task_dir / "environment" / "Dockerfile"
    dockerfile.write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    image_line = f'docker_image = "{docker_image}"\n' if docker_image else ""
    (task_dir / "task.toml").write_text(
        'version = "1.0"\n[task]\nname = "t1jax/' + name + '"\n[environment]\n' + image_line
    )
    return Task(
        task_id=f"t1jax/{name}",
        instruction='Create /app/hello.txt containing "Hello, world!".',
        source_dir=task_dir,
        layout=TaskLayout.HARBOR,
        environment=EnvironmentSpec(
            dockerfile=None if docker_image else dockerfile,
            docker_image=docker_image,
            context_dir=task_dir / "environment",
            allow_internet=allow_internet,
            env=dict(env or {}),
        ),
        tests_dir=task_dir / "tests",
        test_script=Path("test.sh"),
        solution_script=task_dir / "solution" / "solve.sh",
        limits=limits or TaskLimits(agent_timeout_sec=600, verifier_timeout_sec=120, total_timeout_sec=900),
    )


def with_limits(task: Task, agent: float, verifier: float, total: float) -> Task:
    return dataclasses.replace(task, limits=TaskLimits(agent, verifier, total))
