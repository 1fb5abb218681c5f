#!/bin/bash
echo port=8080 > /etc/app.conf
