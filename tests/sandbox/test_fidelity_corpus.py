"""The fidelity corpus (tests/data/fidelity_tasks, both layouts) through check-tasks on both real
backends: every task judged as `expected.toml` says (sound, unsound, stand_in_gap or skipped with its
reason), and no sandbox or container left afterwards.

Behind the `containers` marker (`make test-containers`; also `slow`): it builds every task's image
(and the stand-ins it needs: golang, JDK and GCC roots, ~3 min of mmdebstrap on a fresh machine)
and runs 2 trials per task per backend.
"""

import tomllib

import pytest

from sandbox_service.backends.local import LocalBackend
from sandbox_service.backends.podman import LABEL_RUN, PodmanBackend, PodmanConfig, PodmanEngine
from sandbox_service.check_tasks import check_tasks

from .conftest import REPO, STAND_IN_DIR

pytestmark = [pytest.mark.sandbox, pytest.mark.containers, pytest.mark.slow]

CORPUS = REPO / "tests" / "data" / "fidelity_tasks"
EXPECTED = tomllib.loads((CORPUS / "expected.toml").read_text())


def _verdict(audit) -> str:
    if audit.stand_in_gap:  # not judged, like a skip, but its own verdict
        return audit.verdict
    if audit.skipped:
        return f"skipped:{audit.reason.split(':', 1)[0]}"
    return audit.verdict


@pytest.mark.parametrize("backend_name", ["local", "container"])
def test_every_corpus_task_is_judged_as_expected(backend_name, tmp_path, toolchain_dir):
    run_id = f"fidelity-corpus-{backend_name}-{tmp_path.name}"
    if backend_name == "local":
        backend = LocalBackend(cache_dir=tmp_path, toolchain_dir=toolchain_dir, stand_in_dir=STAND_IN_DIR)
    else:
        backend = PodmanBackend(PodmanConfig(cache_dir=tmp_path, toolchain_dir=toolchain_dir,
                                             stand_in_dir=STAND_IN_DIR, pull="never"))  # fmt: skip
    try:
        audits = check_tasks(CORPUS, backend, run_id=run_id, max_workers=2)
    finally:
        backend.close()
    got = {audit.source_dir.name: _verdict(audit) for audit in audits}
    assert set(got) == set(EXPECTED), "every corpus task is audited, and only those"
    wrong = {
        name: (got[name], EXPECTED[name][backend_name])
        for name in got
        if got[name] != EXPECTED[name][backend_name]
    }
    details = {a.source_dir.name: a.line() for a in audits if a.source_dir.name in wrong}
    assert not wrong, f"judged differently than expected: {wrong}\n" + "\n".join(details.values())
    for audit in audits:
        if not audit.skipped and audit.solution is not None:
            assert audit.backend == backend_name and audit.environment.substitutions  # every stand-in named
            assert audit.solution.output_tail  # the verifier's output is kept in the audit
    assert backend.live_sandboxes(run_id) == []
    left = PodmanEngine().text(
        "ps", "-a", "--filter", f"label={LABEL_RUN}={run_id}", "--format", "{{.Names}}"
    )
    assert left == "", f"containers of the run left behind: {left}"
