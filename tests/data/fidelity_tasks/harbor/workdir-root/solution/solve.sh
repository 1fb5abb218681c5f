#!/bin/bash
set -euo pipefail
test "$(pwd)" = /
echo root > ./where.txt
