#!/bin/bash
set -euo pipefail
# wrong on purpose: counts words, not lines
wc -w < /etc/passwd > /app/lines.txt
