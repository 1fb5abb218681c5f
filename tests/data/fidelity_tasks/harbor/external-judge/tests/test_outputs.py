from pathlib import Path

import requests

# The answer is graded by a remote judge service (as LiveCodeBench Pro's Terminal-Bench tasks do);
# 192.0.2.1 is TEST-NET-1 (RFC 5737), outside any sandbox.
JUDGE = "http://192.0.2.1:8081"


def test_judge_accepts_the_answer():
    answer = Path("/app/answer.txt").read_text().strip()
    response = requests.post(f"{JUDGE}/grade", json={"answer": answer}, timeout=5)
    assert response.json()["accepted"]
