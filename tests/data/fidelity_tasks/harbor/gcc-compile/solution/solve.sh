#!/bin/bash
set -euo pipefail
cd /app && gcc -O2 -o sum sum.c && ./sum 1 2 3 > out.txt
