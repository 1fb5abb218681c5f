#!/bin/bash
# The tests need only pytest, which the verifier provides.
pytest $TEST_DIR/test_outputs.py -rA
