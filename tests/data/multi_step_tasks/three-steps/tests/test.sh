#!/bin/bash
# Shared by every step; each step's own tests/ supplies test_step.py (layered over this directory).
pytest /tests/test_step.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
