"""`t1jax launch --config C --dry-run` on the production config: it loads, validates, gives the
capacity verdict and renders valid manifests (fast, without lowering); the full dry run with the
abstract TPU lowering of the 122B programs is slow. Bad input is one line and exit 2; a failed
check is one line per failure and exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from t1jax.cli import main
from t1jax.controller.config import ConfigError, load_run_config, run_config_from_dict

REPO = Path(__file__).resolve().parents[2]
PRODUCTION = REPO / "configs" / "runs" / "qwen35_122b_a10b.yaml"


def production_raw() -> dict:
    """The production config with its repo-relative preset made absolute (to copy elsewhere)."""
    raw = yaml.safe_load(PRODUCTION.read_text())
    raw["model"]["preset"] = str(REPO / "configs" / "qwen35_122b_a10b.yaml")
    return raw


def write_config(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def dry_run(capsys, config: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["launch", "--config", str(config), "--dry-run", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict[str, tuple[str, str]]:
    """check name -> (status, rest of the line) from the verdict table."""
    table = {}
    for line in out.splitlines()[1:]:
        parts = line.split("  ")
        parts = [p.strip() for p in parts if p.strip()]
        if len(parts) >= 2 and parts[1] in ("pass", "FAIL", "skip"):
            table[parts[0]] = (parts[1], line)
    return table


def test_production_config_loads_validates_and_renders(tmp_path, capsys):
    out_file = tmp_path / "manifests.yaml"
    code, out, err = dry_run(capsys, PRODUCTION, "--no-lower", "--out", str(out_file))
    assert code == 0, err
    table = rows(out)
    for name in ("config", "locations", "devices", "kernels", "capacity actor", "capacity critic",
                 "capacity co-resident", "pathways", "manifests"):  # fmt: skip
        assert table[name][0] == "pass", table[name]
    assert table["lower"][0] == "skip"
    assert "512 devices" in table["devices"][1] and "trainer 256" in table["devices"][1]
    assert "gs://t1jax-runs/qwen35-122b-a10b/state" in table["locations"][1]
    assert "grouped matmul megablox" in table["kernels"][1]
    # deploy/ keeps what the production config renders to (regenerate with the README's command)
    assert out_file.read_text() == (REPO / "deploy" / "qwen35-122b-a10b.yaml").read_text()
    manifests = list(yaml.safe_load_all(out_file.read_text()))
    kinds = [m["kind"] for m in manifests]
    assert kinds[-1] == "JobSet" and "RuntimeClass" not in kinds  # GKE Sandbox provides gvisor
    jobset = manifests[-1]
    workers = next(j for j in jobset["spec"]["replicatedJobs"] if j["name"] == "pathways-worker")
    assert workers["replicas"] == 2  # one job per v5p slice
    quota = next(m for m in manifests if m["kind"] == "ResourceQuota")
    assert quota["spec"]["hard"]["pods"] == "600"


def test_the_resolved_production_config_round_trips():
    config = load_run_config(PRODUCTION, check_paths=False)
    again = run_config_from_dict(config.resolved())
    assert again == config
    assert (
        config.launch.num_slices == 2 and config.model.execution_config().grouped_matmul_kernel == "megablox"
    )


@pytest.mark.slow
def test_full_dry_run_lowers_the_122b_programs(tmp_path, capsys):
    """Abstract TPU lowering of actor_grad, critic_grad (trainer share) and the sampler's decode
    step (sampler share) of the 122B model: minutes on a 2-core CPU."""
    code, out, err = dry_run(capsys, PRODUCTION, "--out", str(tmp_path / "m.yaml"))
    assert code == 0, err
    table = rows(out)
    for name in ("lower actor_grad", "lower critic_grad", "lower sampler"):
        assert table[name][0] == "pass", table[name]
    assert "tpu_custom_call op(s) (Mosaic)" in table["lower actor_grad"][1]


def one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("t1jax launch:") and "lowering" not in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    code, _, err = dry_run(capsys, tmp_path / "missing.yaml")
    assert code == 2 and "does not exist" in one_line_error(err)
    code, _, err = dry_run(capsys, REPO / "configs" / "runs" / "tiny_cpu.yaml")
    assert code == 2 and "no launch: section" in one_line_error(err)
    assert main(["launch", "--config", str(PRODUCTION)]) == 2  # no --dry-run
    assert "only --dry-run" in one_line_error(capsys.readouterr().err)

    raw = production_raw()
    raw["launch"]["replicas"] = 3
    code, _, err = dry_run(capsys, write_config(tmp_path, raw))
    assert code == 2 and "unknown launch parameter(s) ['replicas']" in one_line_error(err)

    raw = production_raw()
    raw["checkpoint"]["state_directory"] = "gs://Bad_Bucket/state"
    code, _, err = dry_run(capsys, write_config(tmp_path, raw))
    assert code == 2 and "Invalid GCS bucket name" in one_line_error(err)

    raw = production_raw()
    raw["sandboxes"]["namespace"] = "elsewhere"
    code, _, err = dry_run(capsys, write_config(tmp_path, raw))
    assert code == 2 and "launch.sandbox_namespace" in one_line_error(err)

    raw = production_raw()
    raw["model"]["execution"]["grouped_matmul_kernel"] = "gmm"
    code, _, err = dry_run(capsys, write_config(tmp_path, raw))
    assert code == 2 and "grouped_matmul_kernel must be one of" in one_line_error(err)


def test_failed_checks_are_one_line_each_and_exit_1(tmp_path, capsys):
    raw = production_raw()
    raw["launch"]["num_slices"] = 1  # 256 devices for a 256 + 256 split
    raw["model"]["execution"]["gated_delta_rule_kernel"] = "pallas"  # no context-parallel form
    code, out, err = dry_run(capsys, write_config(tmp_path, raw), "--no-lower", "--memory-gb", "40",
                             "--out", str(tmp_path / "m.yaml"))  # fmt: skip
    assert code == 1
    table = rows(out)
    failed = [line for line in err.splitlines() if line.startswith("t1jax launch: check failed:")]
    assert {name for name, (status, _) in table.items() if status == "FAIL"} == {
        "devices", "kernels", "capacity actor", "capacity critic", "capacity co-resident"
    }  # fmt: skip
    assert len(failed) == 5
    assert "exceed the 256 of the launch" in table["devices"][1]
    assert "no context-parallel form" in table["kernels"][1]


def test_run_config_object_store_urls_are_checked_by_tensorstore():
    raw = production_raw()
    for bad, message in (
        ("gs://", "Invalid GCS bucket name"),
        ("gs://bucket-only", "not the bucket's root"),
        ("s3://bucket/path", "must be a gs://bucket/path URL"),
    ):
        raw["checkpoint"]["state_directory"] = bad
        with pytest.raises(ConfigError, match=message):
            run_config_from_dict(raw).check()
    raw["checkpoint"]["state_directory"] = "gs://t1jax-runs/x"
    raw["tasks"]["directory"] = "gs://t1jax-runs/tasks"
    with pytest.raises(ConfigError, match="tasks.directory: .*only checkpoint.state_directory"):
        run_config_from_dict(raw).check()
