#!/bin/bash
set -euo pipefail
log=/app/logs/access.log
{
  echo "requests=$(wc -l < "$log")"
  echo "unique_ips=$(awk '{print $1}' "$log" | sort -u | wc -l)"
  echo "errors=$(awk '$4 >= 400' "$log" | wc -l)"
  echo "bytes=$(awk '{s += $5} END {print s}' "$log")"
  echo "top_path=$(awk '{print $3}' "$log" | sort | uniq -c | sort -rn | head -1 | awk '{print $2}')"
} > /app/summary.txt
awk '$4 >= 400' "$log" > /app/errors.log
