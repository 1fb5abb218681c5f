#!/bin/bash
set -euo pipefail
useradd -u 1200 -m deploy
chown -R deploy:deploy /srv/app
tar -C /srv/app -xzpf /opt/bundle.tar.gz
