#!/bin/bash
set -euo pipefail
# Harbor puts the solution directory at /solution.
python3 /solution/count_words.py /app/corpus.txt > /app/count.txt
