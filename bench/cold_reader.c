/* Reads FILES files named fNNNNN.bin under DIR (from FIRST on), whole, with THREADS
 * readers taking the next file in turn, and prints files per second. The cold small-file
 * reader of bench/small-files-cold.sh: a C loop, so the reader's own cost stays out of
 * the figure.
 *
 *     cold_reader THREADS DIR FIRST FILES
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static char **paths;
static int n, next_i;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void *work(void *arg) {
    (void)arg;
    char *buf = aligned_alloc(4096, 1 << 20);
    long total = 0;
    for (;;) {
        pthread_mutex_lock(&mu);
        int i = next_i++;
        pthread_mutex_unlock(&mu);
        if (i >= n)
            break;
        int fd = open(paths[i], O_RDONLY);
        if (fd < 0) {
            perror(paths[i]);
            exit(1);
        }
        ssize_t r;
        while ((r = read(fd, buf, 1 << 20)) > 0)
            total += r;
        if (r < 0) {
            perror(paths[i]);
            exit(1);
        }
        close(fd);
    }
    free(buf);
    return (void *)total;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s THREADS DIR FIRST FILES\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[1]), first = atoi(argv[3]);
    n = atoi(argv[4]);
    if (threads < 1 || threads > 64 || n < 1) {
        fprintf(stderr, "THREADS is 1..64, FILES at least 1\n");
        return 2;
    }
    paths = malloc(sizeof(char *) * n);
    for (int i = 0; i < n; i++) {
        paths[i] = malloc(4096);
        snprintf(paths[i], 4096, "%s/f%05d.bin", argv[2], first + i);
    }
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    pthread_t t[64];
    for (int i = 0; i < threads; i++)
        pthread_create(&t[i], 0, work, 0);
    long total = 0;
    for (int i = 0; i < threads; i++) {
        void *r;
        pthread_join(t[i], &r);
        total += (long)r;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    double s = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
    printf("%.0f\n", n / s);
    return 0;
}
