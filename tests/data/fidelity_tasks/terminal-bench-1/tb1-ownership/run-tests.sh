#!/bin/bash
# Terminal-Bench 1.x style: the harness copies run-tests.sh and tests/ to /tests.
cd /tests
pytest $TEST_DIR/test_outputs.py -rA
