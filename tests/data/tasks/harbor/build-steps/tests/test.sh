#!/bin/bash
cd /app
pytest /tests/test_outputs.py -rA
