#!/bin/bash
set -euo pipefail
python --version > /app/greeting.txt
