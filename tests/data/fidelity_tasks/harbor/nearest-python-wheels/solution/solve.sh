#!/bin/bash
python3 -c "import numpy; print(int(numpy.arange(1, 101).sum()))" > /app/sum.txt
