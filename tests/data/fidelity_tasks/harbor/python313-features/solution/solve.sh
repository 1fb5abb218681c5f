#!/bin/bash
set -euo pipefail
python3 -c 'import copy, sys; sys.path.insert(0, "/app"); from point import Point; print(copy.replace(Point(1, 2), y=5))' > /app/result.txt
