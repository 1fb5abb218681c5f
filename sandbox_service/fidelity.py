"""Which backend runs a task, on what image, and why a task is skipped: `environment_audit`.

This module owns the one question every caller that scores tasks must ask before trusting a score:
how will `provider` run `task`? The answer is an `EnvironmentAudit` (`contracts`): the backend, the
image that runs, every base image replaced by a stand-in (with how it differs), or the reason the
task is skipped. `check-tasks` writes it into each task's audit, and `t1jax eval` into each
result, so no score is silently earned on a different image.

Backends answer for their own environments (`provider.environment_audit(task)`: the local
backend knows its Dockerfile subset and stand-in roots, the container backend resolves base
images against the engine and registries). Two rules hold for every backend and are applied here:
a task with `gpus > 0` is skipped (no backend here has GPUs), and a task whose reference solution
downloads (curl, apt-get, pip install, git clone, ...) is skipped as `needs_internet` when the
task allows internet but the provider gives it none (the solution could not pass, so judging the
task on it would be wrong). Wrappers (`AdmissionController`, `SandboxServiceClient`) pass the
question on to the backend behind them.

Some reasons only show once a build runs: `build_failure_skip` reads a failed build's output and
names the hosts it could not resolve (`unreachable_host`): a Dockerfile that fetches from a host
this machine cannot reach says nothing about the task, so the task is skipped, not judged unsound.
An Ubuntu PPA (`add-apt-repository ppa:...`) counts as such a host (Launchpad), though
add-apt-repository hides the failed lookup behind a traceback. `verifier_network_skip` does the
same for a reference solution whose tests fail only because they connect to a host outside the
sandbox (an external judge service): `needs_internet`, naming the host.

Invariant: `environment_audit` starts no sandbox and never raises for a task that loaded; a backend
that cannot describe itself gets an audit saying so (`detail`), with `substitutions` unknown (empty).
"""

from __future__ import annotations

import dataclasses
import re

from sandbox_service.contracts import EnvironmentAudit, SandboxProvider, SkipReason, Task
from sandbox_service.solution import solution_network_use


def environment_audit(task: Task, provider: SandboxProvider) -> EnvironmentAudit:
    """How `provider` will run `task` (see the module docstring)."""
    audit_of = getattr(provider, "environment_audit", None)
    if audit_of is not None:
        return audit_of(task)
    name = getattr(provider, "name", type(provider).__name__)
    image = task.environment.docker_image or (
        f"built from {task.environment.dockerfile}" if task.environment.dockerfile else None
    )
    audit = EnvironmentAudit(
        task.task_id, name, image, (), (), None, f"{name} does not report base-image substitutions"
    )
    return apply_common_rules(audit, task, internet_granted=task.environment.allow_internet)


def apply_common_rules(
    audit: EnvironmentAudit, task: Task, *, internet_granted: bool, verifies_steps: bool = True
) -> EnvironmentAudit:
    """`audit` with the rules every backend shares (GPU, needs-internet, multi-step) applied, if it
    is runnable. `verifies_steps` False: the backend verifies once per sandbox (it stops the agent's
    processes first), so a multi-step task is skipped."""
    if not audit.runnable:
        return audit
    if task.steps and not verifies_steps:
        detail = multi_step_refusal(audit.backend)
        return dataclasses.replace(audit, skip_reason=SkipReason.MULTI_STEP, detail=detail)
    if task.environment.gpus > 0:
        return dataclasses.replace(
            audit,
            skip_reason=SkipReason.NEEDS_GPU,
            detail=f"the task asks for {task.environment.gpus} GPU(s)",
        )
    if task.environment.allow_internet and not internet_granted:
        views = [task] + [dataclasses.replace(task, solution_script=s.solution_script) for s in task.steps]
        command = next(filter(None, map(solution_network_use, views)), None)
        if command is not None:
            return dataclasses.replace(
                audit,
                skip_reason=SkipReason.NEEDS_INTERNET,
                detail=f"its reference solution runs {command!r} and {audit.backend} gives this task "
                "no network "
                "(the task allows internet; --allow-internet lets it through)",
            )
    return audit


def multi_step_refusal(backend: str) -> str:
    return (
        f"a multi-step task: the {backend} backend stops the agent's processes to verify, so it cannot "
        "carry a step's environment into the next (the local and container backends can)"
    )


# What resolvers, downloaders and package managers print when a host name does not resolve; each
# pattern captures the host.
_UNRESOLVED_HOST_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        r"Could not resolve host: ([\w.-]+)",  # curl, git over https
        r"unable to resolve host address [‘'\"]([\w.-]+)",  # wget
        r"(?:Temporary failure resolving|Could not resolve) '([\w.-]+)'",  # apt
        r"host='([\w.-]+)'[^\n]*(?:NameResolutionError|Temporary failure in name resolution|"
        r"Name or service not known)",  # pip / urllib3
        r"dial tcp: lookup ([\w.-]+)[^\n]*(?:no such host|server misbehaving)",  # go
        r"getaddrinfo (?:ENOTFOUND|EAI_AGAIN) ([\w.-]+)",  # npm, node
        r"ssh: Could not resolve hostname ([\w.-]+)",
    )
)


def unresolved_hosts(output: str) -> tuple[str, ...]:
    """The host names `output` (a build's log) says could not be resolved, in first-seen order."""
    hosts: dict[str, None] = {}
    for pattern in _UNRESOLVED_HOST_PATTERNS:
        for match in pattern.finditer(output):
            hosts.setdefault(match.group(1).rstrip(".").lower(), None)
    return tuple(hosts)


def earlier_steps_note(hosts: tuple[str, ...]) -> str:
    """A line for a build error naming hosts that earlier, succeeded steps could not resolve
    (`curl ... | sh` succeeds when the download fails; only a later step notices nothing was
    installed), worded so that `unresolved_hosts` reads them back; '' for none."""
    if not hosts:
        return ""
    return "\n(earlier steps: " + "; ".join(f"Could not resolve host: {host}" for host in hosts) + ")"


# add-apt-repository of an Ubuntu PPA: it asks api.launchpad.net and, when that cannot be reached,
# dies in a traceback of its ppa module without naming the host.
_PPA_FAILURE = re.compile(r"softwareproperties/ppa\.py|add-apt-repository\b[^\n']*\bppa:")
LAUNCHPAD_HOST = "api.launchpad.net"

# What a test's HTTP client or socket says when a host outside the sandbox cannot be reached;
# each pattern captures the host (and port).
_UNREACHABLE_PEER_PATTERNS = tuple(
    re.compile(pattern)
    for pattern in (
        r"host='([\w.:-]+)', port=(\d+)\)[^\n]*?(?:Network is unreachable|No route to host|"
        r"Name or service not known|Temporary failure in name resolution|NameResolutionError)",  # urllib3
        r"Failed to connect to ([\w.:-]+) port (\d+)",  # curl (offline, only loopback answers at all)
    )
)
_LOOPBACK = re.compile(r"^(localhost|127\.[\d.]+|::1|0\.0\.0\.0)$")


def verifier_network_skip(output: str) -> tuple[SkipReason, str] | None:
    """Why a task whose reference solution failed verification is skipped, or None: its tests
    (`output`, the verifier's console) could not reach a host outside the sandbox, so the failure
    says nothing about the task here. Loopback addresses never count (a service the task asks the
    agent to run is the task's business)."""
    peers: dict[str, None] = {}
    for pattern in _UNREACHABLE_PEER_PATTERNS:
        for match in pattern.finditer(output):
            if not _LOOPBACK.match(match.group(1)):
                peers.setdefault(f"{match.group(1)}:{match.group(2)}", None)
    for host in unresolved_hosts(output):
        if not _LOOPBACK.match(host):
            peers.setdefault(host, None)
    if not peers:
        if "Network is unreachable" in output:  # urllib, http.client, sockets: no host named
            return SkipReason.NEEDS_INTERNET, (
                "its tests connect outside the sandbox (Network is unreachable), which has no network"
            )
        return None
    return SkipReason.NEEDS_INTERNET, (
        f"its tests connect to {', '.join(list(peers)[:4])}, which the sandbox cannot reach"
    )


def build_failure_skip(error: BaseException) -> tuple[SkipReason, str] | None:
    """Why a task whose sandbox failed to start is skipped rather than judged, or None.

    A build that failed after a host name did not resolve is `unreachable_host` (the task may well
    be fine where that host is reachable). Every other failure is the task's own (None)."""
    message = str(error)
    if "build" not in message.lower() and "dockerfile" not in message.lower():
        return None
    hosts = unresolved_hosts(message)
    if not hosts and _PPA_FAILURE.search(message):
        return SkipReason.UNREACHABLE_HOST, (
            f"building its image adds an Ubuntu PPA, which needs {LAUNCHPAD_HOST} (Launchpad); "
            "this machine cannot reach it"
        )
    if not hosts:
        return None
    named = ", ".join(hosts[:4]) + (f" and {len(hosts) - 4} more" if len(hosts) > 4 else "")
    return SkipReason.UNREACHABLE_HOST, (
        f"building its image fetches from {named}, which this machine cannot reach"
    )


# What a build or a solution prints when a package it names does not exist for the stand-in's
# version of a language or distribution release; each pattern captures the package.
_STAND_IN_GAP_PATTERNS = (
    (re.compile(r"No matching distribution found for ([^\s]+)"), "pip finds no {} for this Python"),
    (re.compile(r"Could not find a version that satisfies the requirement ([^\s]+)"),
     "pip finds no {} for this Python"),
    (re.compile(r"[Rr]equires-[Pp]ython [^\n]*?(?:for|of) ([^\s]+)"), "{} requires another Python"),
    (re.compile(r"Unable to locate package ([^\s]+)"), "apt finds no package {} in this release"),
    (re.compile(r"Package '?([^\s']+)'? has no installation candidate"),
     "apt has no installation candidate for {} in this release"),
    (re.compile(r"Version '([^']+' for '[^']+)' was not found"), "apt has no version {} in this release"),
)  # fmt: skip


def stand_in_gap(environment: EnvironmentAudit | None, output: str) -> str | None:
    """Why a failed build or reference solution is the stand-in's doing, not the task's: when a
    stand-in substitutes another version of the language or the distribution ("... instead of
    ...") and `output` says a package the task names does not exist there (no wheel or
    distribution for that Python, no such package or version in that release), the substitution
    and the failure in one line; else None."""
    if environment is None:
        return None
    versioned = [
        (substitution, difference)
        for substitution in environment.substitutions
        for difference in substitution.differences
        if " instead of " in difference
    ]
    if not versioned:
        return None
    for pattern, words in _STAND_IN_GAP_PATTERNS:
        match = pattern.search(output)
        if match:
            substitution, difference = versioned[0]
            stand_in = substitution.used.rsplit("/", 1)[-1].split(":")[0]
            return f"{stand_in} for {substitution.requested}: {difference}; {words.format(match.group(1))}"
    return None
