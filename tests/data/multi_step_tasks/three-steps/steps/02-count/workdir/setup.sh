#!/bin/bash
# Run by Harbor from the workdir before the step's agent.
printf 'red\ngreen\nblue\n' > words.txt
