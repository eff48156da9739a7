/* Opens a file, reads its first byte and closes it, N times; prints microseconds per
 * open. Used by bench/passthrough-open.sh: each open of a passthrough file is an OPEN
 * and a RELEASE round trip to the mount. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s FILE N\n", argv[0]);
        return 2;
    }
    int n = atoi(argv[2]);
    char b[1];
    struct timespec a, z;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) {
        int fd = open(argv[1], O_RDONLY);
        if (fd < 0) {
            perror("open");
            return 1;
        }
        if (pread(fd, b, 1, 0) != 1) {
            perror("pread");
            return 1;
        }
        close(fd);
    }
    clock_gettime(CLOCK_MONOTONIC, &z);
    double s = (z.tv_sec - a.tv_sec) + (z.tv_nsec - a.tv_nsec) / 1e9;
    printf("%.2f\n", s * 1e6 / n);
    return 0;
}
