#!/bin/bash
set -euo pipefail
python -c 'import sys; print(sys.prefix)' > /app/prefix.txt
