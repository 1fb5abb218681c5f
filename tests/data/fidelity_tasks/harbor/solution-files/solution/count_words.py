import sys
print(len(open(sys.argv[1]).read().split()))
