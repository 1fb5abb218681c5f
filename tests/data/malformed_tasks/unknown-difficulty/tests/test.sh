#!/bin/bash
pytest /tests/test_outputs.py -rA
