#!/bin/bash
# Harbor runs a step's workdir/setup.sh from the workdir before the step's agent.
cp seed.in seed.txt
