#!/bin/bash
set -euo pipefail
cd /app
printf 'public class Hello { public static void main(String[] a) { System.out.println("hi"); } }\n' > Hello.java
javac Hello.java && java Hello > out.txt
