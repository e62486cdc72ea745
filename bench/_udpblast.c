/* bench/netvis.py's packet source and sink: 64-byte UDP datagrams at a paced rate. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    char buf[BATCH][2048];
    struct iovec iov[BATCH];
    struct mmsghdr m[BATCH];
    memset(m, 0, sizeof m);
    for (int i = 0; i < BATCH; i++) {
        memset(buf[i], 'p', 64);
        iov[i].iov_base = buf[i];
        iov[i].iov_len = argv[1][0] == 's' ? 64 : 2048;
        m[i].msg_hdr.msg_iov = &iov[i];
        m[i].msg_hdr.msg_iovlen = 1;
    }
    if (argv[1][0] == 's') { /* send PORT RATE SECONDS */
        if (argc < 5 || connect(fd, (void *)&a, sizeof a)) return 1;
        double rate = atof(argv[3]), seconds = atof(argv[4]), start = now(), t;
        long sent = 0;
        while ((t = now()) < start + seconds) {
            long due = (long)((t - start) * rate) - sent;
            if (due <= 0) {
                struct timespec nap = {0, 200000};
                nanosleep(&nap, NULL);
                continue;
            }
            int n = sendmmsg(fd, m, due < BATCH ? due : BATCH, 0);
            if (n > 0) sent += n;
        }
        struct rusage u;
        getrusage(RUSAGE_SELF, &u);
        printf("%ld %f\n", sent, u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 +
                                     u.ru_stime.tv_sec + u.ru_stime.tv_usec / 1e6);
        return 0;
    }
    /* recv PORT FILE: read until killed; the count into FILE every 50 ms */
    int big = 8 << 20;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &big, sizeof big);
    struct timeval tv = {0, 50000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (bind(fd, (void *)&a, sizeof a)) return 1;
    int out = open(argv[3], O_WRONLY | O_CREAT | O_TRUNC, 0644);
    long count = 0;
    double mark = now();
    for (;;) {
        int n = recvmmsg(fd, m, BATCH, 0, NULL);
        if (n > 0) count += n;
        if (now() - mark > 0.05) {
            char line[32];
            int len = snprintf(line, sizeof line, "%20ld\n", count);
            pwrite(out, line, len, 0);
            mark = now();
        }
    }
}
