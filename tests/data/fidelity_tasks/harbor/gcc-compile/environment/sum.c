#include <stdio.h>
#include <stdlib.h>
int main(int c, char **v) { long s = 0; for (int i = 1; i < c; i++) s += atol(v[i]); printf("%ld\n", s); return 0; }
