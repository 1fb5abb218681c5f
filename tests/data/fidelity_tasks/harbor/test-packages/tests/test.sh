#!/bin/bash
# As Terminal-Bench 2 tasks do: uv fetches pytest and the test's own dependency at verification time
# (no network in the sandbox: the verifier provides tomlkit itself).
curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh
source "$HOME/.local/bin/env"
uvx --python 3.13 --with pytest==8.4.1 --with pytest-json-ctrf==0.3.5 --with tomlkit==0.13.2 \
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
