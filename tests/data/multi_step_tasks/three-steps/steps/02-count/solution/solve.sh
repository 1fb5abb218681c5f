#!/bin/bash
set -euo pipefail
wc -l < /app/words.txt | tr -d " " > /app/count.txt
