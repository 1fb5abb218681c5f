#!/bin/bash
set -euo pipefail
find /var/data -name '*.log' | wc -l > /app/logs.txt
