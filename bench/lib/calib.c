/* The calibration loop of bench/verbs-vs-perftest.sh in C: the same 32-bit
 * multiply-add recurrence as its JS twin, timed in-process. Prints ms. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
  long n = argc > 1 ? atol(argv[1]) : 100000000L;
  volatile unsigned sink;
  unsigned x = 0;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 0; i < n; i++) x = x * 31u + (unsigned)i;
  clock_gettime(CLOCK_MONOTONIC, &b);
  sink = x;
  (void)sink;
  printf("%.1f\n", (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6);
  return 0;
}
