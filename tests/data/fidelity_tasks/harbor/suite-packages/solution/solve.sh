#!/bin/bash
set -euo pipefail
python3 -m venv /opt/env
/opt/env/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])' > /app/version.txt
