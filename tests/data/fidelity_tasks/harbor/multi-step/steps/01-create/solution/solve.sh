#!/bin/bash
set -euo pipefail
echo alpha > /app/a
printf 'import time\nwhile True:\n    time.sleep(1)\n' > /app/keeper.py
nohup python3 /app/keeper.py > /dev/null 2>&1 &
echo $! > /app/keeper.pid
