#!/bin/bash
set -euo pipefail
echo ok > /srv/site/index.html
cd /srv/site
nohup python3 -m http.server 8080 > /tmp/http.log 2>&1 &
for i in $(seq 100); do
  python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8080/', timeout=1)" 2>/dev/null && break
  sleep 0.1
done
