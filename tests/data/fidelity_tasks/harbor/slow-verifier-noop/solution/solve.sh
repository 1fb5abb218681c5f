#!/bin/bash
set -euo pipefail
touch /app/ready
