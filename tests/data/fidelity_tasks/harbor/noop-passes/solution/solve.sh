#!/bin/bash
set -euo pipefail
test -e /etc/hostname
