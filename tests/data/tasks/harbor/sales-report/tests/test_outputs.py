import csv
import json
import os
from pathlib import Path

CLEAN = Path("/app/clean.csv")
REPORT = Path(os.environ.get("REPORT_PATH", "/app/report.json"))


def _report():
    return json.loads(REPORT.read_text())


def test_clean_csv_keeps_header():
    with CLEAN.open() as handle:
        assert next(csv.reader(handle)) == ["region", "product", "units", "unit_price"]


def test_clean_csv_drops_rows_without_units():
    with CLEAN.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["units"] for row in rows] == ["10", "3", "7", "5", "2", "1"]


def test_row_count():
    assert _report()["row_count"] == 6


def test_total_units():
    assert _report()["total_units"] == 28


def test_total_revenue():
    assert _report()["total_revenue"] == 287.48


def test_revenue_by_region():
    assert _report()["revenue_by_region"] == {"north": 25.0, "south": 42.5, "east": 217.48, "west": 2.5}


def test_top_product():
    assert _report()["top_product"] == "widget"
