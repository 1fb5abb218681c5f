#!/bin/bash
# Shared by both steps; each step's own tests/ supplies test_step.py (Harbor layers them in /tests).
pytest /tests/test_step.py -rA
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
