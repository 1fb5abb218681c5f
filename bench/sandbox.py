"""Sandbox service overhead, measured against a bare bubblewrap process in the same run.

1. Exec round trip (median of N) of `true`:
   - bare:     `bwrap --unshare-all ... /bin/bash -c true` as a fresh subprocess (no service, no
               sandbox kept alive: the floor for "run a command isolated");
   - backend:  `LocalSandbox.exec` in-process (nsenter into a live sandbox, cgroups, setpriv);
   - admitted: the same through `AdmissionController` (deadline bookkeeping, watchdog registration);
   - service:  HTTP client -> uvicorn server -> admission -> local backend (what the controller uses).
   Prints each and the ratio service / bare.
2. Sandboxes created + closed per second with the token bucket off, through the service:
   sequentially and from 8 client threads.

Usage: python bench/sandbox.py [--iterations 50] [--creates 24] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sandbox_service.admission import AdmissionConfig, AdmissionController  # noqa: E402
from sandbox_service.backends.local import LocalBackend  # noqa: E402
from sandbox_service.client import SandboxServiceClient  # noqa: E402
from sandbox_service.server import ServiceThread, TaskStore, create_app  # noqa: E402
from sandbox_service.tasks import load_task  # noqa: E402
from sandbox_service.verifier import DEFAULT_TOOLCHAIN_DIR, setup_toolchain  # noqa: E402

TASK_DIR = REPO / "tests" / "data" / "tasks" / "harbor" / "hello-world"


def bare_bwrap_argv() -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib64", "sbin"):
        path = f"/{name}"
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    return argv + ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "/bin/bash", "-c", "true"]


def interleaved_medians(runs: dict[str, object], iterations: int, warmup: int = 3) -> dict[str, float]:
    """Median wall time of each callable, measured round-robin so that load from other processes
    on the machine affects every variant alike."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(iterations):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--creates", type=int, default=24)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()

    toolchain = setup_toolchain(REPO / DEFAULT_TOOLCHAIN_DIR, quiet=True).directory
    task = load_task(TASK_DIR)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="t1jax-bench-") as scratch:
        backend = LocalBackend(cache_dir=Path(scratch) / "cache", toolchain_dir=toolchain)
        policy = AdmissionConfig(create_rate_per_sec=None, max_live_sandboxes=64)
        controller = AdmissionController(backend, policy)
        service = ServiceThread(create_app(controller, TaskStore(Path(scratch) / "store"))).start()
        client = SandboxServiceClient(service.url)
        try:
            argv = bare_bwrap_argv()
            direct = backend.create(task, run_id="bench")
            admitted = controller.create(task, run_id="bench")
            remote = client.create(task, run_id="bench")
            print(f"exec round trip of `true`, median of {args.iterations} (interleaved):", flush=True)
            medians = interleaved_medians(
                {
                    "bare_bwrap_sec": lambda: subprocess.run(argv, check=True),
                    "backend_exec_sec": lambda: direct.exec("true", 30),
                    "admitted_exec_sec": lambda: admitted.exec("true", 30),
                    "service_exec_sec": lambda: remote.exec("true", 30),
                    "service_health_sec": client.health,
                },
                args.iterations,
            )
            for sandbox in (direct, admitted, remote):
                sandbox.close()
            results.update(medians)
            labels = {
                "bare_bwrap_sec": "bare bwrap subprocess",
                "backend_exec_sec": "local backend exec",
                "admitted_exec_sec": "+ admission control",
                "service_exec_sec": "+ HTTP service (client)",
                "service_health_sec": "HTTP round trip alone (GET /health)",
            }
            for key, label in labels.items():
                print(f"  {label:36s} {results[key] * 1e3:8.2f} ms", flush=True)
            results["service_over_bare"] = results["service_exec_sec"] / results["bare_bwrap_sec"]
            results["service_over_backend"] = results["service_exec_sec"] / results["backend_exec_sec"]
            print(f"  ratio service / bare bwrap         {results['service_over_bare']:.2f}x", flush=True)
            print(f"  ratio service / backend exec       {results['service_over_backend']:.2f}x", flush=True)

            def create_close() -> None:
                client.create(task, run_id="bench").close()

            print(
                f"sandboxes created + closed via the service, bucket off ({args.creates} each):", flush=True
            )
            create_close()  # the environment build is cached after this
            started = time.perf_counter()
            for _ in range(args.creates):
                create_close()
            results["create_close_per_sec_sequential"] = args.creates / (time.perf_counter() - started)
            rate = results["create_close_per_sec_sequential"]
            print(f"  sequential                           {rate:8.2f} /s", flush=True)
            started = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda _: create_close(), range(args.creates)))
            results["create_close_per_sec_8_threads"] = args.creates / (time.perf_counter() - started)
            rate = results["create_close_per_sec_8_threads"]
            print(f"  8 client threads                     {rate:8.2f} /s", flush=True)
            leaks = client.leak_check("bench")
            assert not leaks.leaked, leaks
        finally:
            client.close()
            service.stop()
            backend.close()
    print(f"(machine: {os.cpu_count()} CPUs; the default creation rate of the service is 6/s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
