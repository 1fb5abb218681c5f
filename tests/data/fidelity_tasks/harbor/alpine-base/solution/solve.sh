#!/bin/bash
set -euo pipefail
echo alpine > /app/os.txt
