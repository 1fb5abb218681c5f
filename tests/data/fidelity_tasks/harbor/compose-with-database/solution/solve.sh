#!/bin/bash
set -euo pipefail
echo 3 > /app/count.txt
