#!/bin/bash
set -euo pipefail
tr a-z A-Z < /app/one.txt > /app/final.txt
