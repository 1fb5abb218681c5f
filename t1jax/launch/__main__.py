"""`python -m t1jax.launch render PARAMS.yaml [--out FILE] [--kubernetes-version V]`: render the
run's manifests from a parameter file, validate them offline, and write them as one multi-document
YAML (stdout by default). Bad parameters or a manifest the API would reject: one line, exit 2."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from sandbox_service.cli_contract import OneLineArgumentParser, UsageError, checking_input, run_command
from t1jax.launch.manifests import LaunchParams, manifest_names, render_manifests
from t1jax.launch.validate import DEFAULT_KUBERNETES_VERSION, ManifestError, validate_manifests
from t1jax.yamlio import load_yaml


def rendered_yaml(manifests) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=True, default_flow_style=False)


def main(argv=None) -> int:
    parser = OneLineArgumentParser(prog="python -m t1jax.launch")
    commands = parser.add_subparsers(dest="command", required=True)
    render = commands.add_parser("render", help="render and validate a run's Kubernetes manifests")
    render.add_argument("params", type=Path, help="YAML mapping of LaunchParams fields")
    render.add_argument("--out", type=Path, default=None, help="output file (default: stdout)")
    render.add_argument("--kubernetes-version", default=DEFAULT_KUBERNETES_VERSION)
    render.add_argument("--debug", action="store_true", help="show tracebacks")
    args = parser.parse_args(argv)
    return run_command(f"python -m t1jax.launch {args.command}", lambda: _render(args), debug=args.debug)


def _render(args) -> int:
    with checking_input(TypeError, yaml.YAMLError):
        values = load_yaml(args.params.read_text())
        if not isinstance(values, dict):
            raise UsageError(f"{args.params} must hold a mapping of launch parameters")
        manifests = render_manifests(LaunchParams.from_mapping(values))
        try:
            validate_manifests(manifests, args.kubernetes_version)
        except ManifestError as error:
            raise UsageError(f"invalid manifest: {error}") from error
    text = rendered_yaml(manifests)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(f"{len(manifests)} manifests valid for Kubernetes {args.kubernetes_version}: "
          + ", ".join(manifest_names(manifests)), file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
