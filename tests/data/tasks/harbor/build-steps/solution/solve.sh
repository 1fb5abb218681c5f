#!/bin/bash
set -euo pipefail
greet agent > /app/greeting.txt
grep -c . /srv/shared/inventory.txt > /app/count.txt
sed -i 's/^debug = true$/debug = false/' /app/config/app.ini
