#!/bin/bash
cut -d= -f2 /etc/app.conf > /app/report.txt
