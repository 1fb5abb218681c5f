#!/bin/bash
set -euo pipefail
python3 - <<'PY'
import csv, json, os
from collections import defaultdict

with open("/app/data/sales.csv") as handle:
    reader = csv.DictReader(handle)
    header = reader.fieldnames
    rows = [row for row in reader if row["units"].strip()]
with open("/app/clean.csv", "w", newline="") as handle:
    writer = csv.DictWriter(handle, fieldnames=header)
    writer.writeheader()
    writer.writerows(rows)
revenue = defaultdict(float)
units = defaultdict(int)
for row in rows:
    revenue[row["region"]] += int(row["units"]) * float(row["unit_price"])
    units[row["product"]] += int(row["units"])
report = {
    "row_count": len(rows),
    "total_units": sum(units.values()),
    "total_revenue": round(sum(revenue.values()), 2),
    "revenue_by_region": {region: round(value, 2) for region, value in revenue.items()},
    "top_product": max(units, key=units.get),
}
with open(os.environ["REPORT_PATH"], "w") as handle:
    json.dump(report, handle)
PY
