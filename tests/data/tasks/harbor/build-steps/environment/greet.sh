#!/bin/sh
# Prints a greeting built from the image's environment and its bundled version file.
echo "${GREETING_WORD}, $1! (greeter $(cat /opt/greeter/VERSION))"
