#!/bin/bash
set -euo pipefail
echo one > /app/one.txt
