#!/bin/bash
set -euo pipefail
echo "$(tr a-z A-Z < /app/a | tr -d '\n')-$(cat /app/seed.txt)" > /app/b
