#!/bin/bash
set -euo pipefail
report > /app/report.txt
