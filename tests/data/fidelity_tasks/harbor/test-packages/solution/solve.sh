#!/bin/bash
set -euo pipefail
printf '[server]\nport = 8080\n' > /app/config.toml
