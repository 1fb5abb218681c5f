#!/bin/bash
set -euo pipefail
stamp > /app/stamp.txt
