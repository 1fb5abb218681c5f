#!/bin/bash
# The image's own pytest (7.4, without pytest-json-ctrf), called by its path and as a module.
/usr/local/bin/pytest /tests/test_outputs.py -rA && python3 -m pytest /tests/test_outputs.py -q
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
