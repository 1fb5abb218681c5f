#!/bin/bash
set -euo pipefail
export GOCACHE=/tmp/gocache GOFLAGS=-mod=mod
cd /app && go build -o hello hello.go && ./hello > out.txt
