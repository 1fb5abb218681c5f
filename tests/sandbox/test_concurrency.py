"""32 sandboxes at once: each isolated from the others, correct scores, nothing leaked afterwards."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import assert_sandbox_gone, count_processes, mounts_mentioning, sandbox_processes

pytestmark = pytest.mark.sandbox

SANDBOXES = 32


def test_32_concurrent_sandboxes_without_leaks(backend, hello_task):
    start = threading.Barrier(SANDBOXES)
    sandboxes = []
    lock = threading.Lock()

    def trial(index: int):
        start.wait()  # create them all at the same moment
        sandbox = backend.create(hello_task, run_id="concurrency")
        with lock:
            sandboxes.append(sandbox)
        try:
            # the daemon is backgrounded: wait (up to 10 s) until it has exec'd, or a loaded host
            # counts its not-yet-exec'd shell and the check below sees 1 process instead of 2
            count = count_processes("sleep?*")
            started = f'for i in $(seq 200); do [ "$({count})" -ge 2 ] && break; sleep 0.05; done; '
            daemon = "setsid sleep 600 > /dev/null 2>&1 & "
            marker = sandbox.exec(f"echo {index} > /tmp/marker; {daemon}{started}cat /tmp/marker", 60)
            seen = sandbox.exec("ls /app; cat /tmp/marker; " + count_processes("sleep?*"), 60).stdout.split()
            if index % 2 == 0:
                sandbox.exec('echo "Hello, world!" > /app/hello.txt', 60)
            report = sandbox.verify()
            return index, marker.stdout.strip(), seen, report
        finally:
            sandbox.close()

    with ThreadPoolExecutor(max_workers=SANDBOXES) as pool:
        results = list(pool.map(trial, range(SANDBOXES)))

    for index, marker, seen, report in results:
        assert marker == str(index)
        assert seen == [str(index), "2"]  # an empty /app, its own marker, its own init + its own daemon
        expected = (2, 2) if index % 2 == 0 else (0, 2)
        assert report.parsed and (report.passed, report.total) == expected, report.detail
    assert len({s.sandbox_id for s in sandboxes}) == SANDBOXES
    for sandbox in sandboxes:
        assert_sandbox_gone(sandbox)
    assert backend.live_sandboxes("concurrency") == []
    for sandbox in sandboxes:  # (other services on this host may have sandboxes of their own)
        assert mounts_mentioning(f"t1jax-staging-{sandbox.sandbox_id}") == []
    assert all(sandbox_processes(s) == [] for s in sandboxes)
