#!/bin/bash
set -euo pipefail
cd /app && javac Main.java && java Main > out.txt
