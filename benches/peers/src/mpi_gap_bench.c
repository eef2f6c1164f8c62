/* mpi_gap_bench.c - MPI_Allreduce after idle time, the Open MPI peer of
 * `chorus-perf allreduce --gap MS` and gloo_gap_bench.py: per size, the warm-up calls back to
 * back, then every timed call after a sleep of MS milliseconds and an MPI_Barrier, timed on
 * its own; the mean per call, max over ranks, in the peers format. The result of one more
 * call is checked against the exact sum of integer-valued inputs.
 *
 *   mpicc -O2 -o mpi_gap_bench mpi_gap_bench.c
 *   mpirun -np 4 ... mpi_gap_bench [-b 8] [-e 2M] [-f 4] [-w 3] [-n 20] [--gap 30]
 */
#include <errno.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static long parse_size(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || v < 0) return -1;
    switch (*end) {
    case 'k': case 'K': v *= 1024.0; end++; break;
    case 'm': case 'M': v *= 1024.0 * 1024.0; end++; break;
    case 'g': case 'G': v *= 1024.0 * 1024.0 * 1024.0; end++; break;
    default: break;
    }
    if (*end != '\0' || v > 1e12) return -1;
    return (long)v;
}

static void sleep_ms(double ms) {
    struct timespec ts;
    ts.tv_sec = (time_t)(ms / 1e3);
    ts.tv_nsec = (long)((ms - (double)ts.tv_sec * 1e3) * 1e6);
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void usage(int rank) {
    if (rank == 0)
        fprintf(stderr, "usage: mpi_gap_bench [-b SIZE] [-e SIZE] [-f N] [-w N] [-n N] [--gap MS]\n");
    MPI_Finalize();
    exit(2);
}

int main(int argc, char **argv) {
    int rank, p;
    long lo = 8, hi = 2L << 20, factor = 4, warmup = 3, iters = 20;
    double gap = 30.0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    for (int i = 1; i < argc; i++) {
        if (i + 1 >= argc) usage(rank);
        const char *o = argv[i], *v = argv[++i];
        if (!strcmp(o, "-b")) lo = parse_size(v);
        else if (!strcmp(o, "-e")) hi = parse_size(v);
        else if (!strcmp(o, "-f")) factor = atol(v);
        else if (!strcmp(o, "-w")) warmup = atol(v);
        else if (!strcmp(o, "-n")) iters = atol(v);
        else if (!strcmp(o, "--gap")) gap = atof(v);
        else usage(rank);
    }
    if (lo < 1 || hi < lo || factor < 2 || warmup < 0 || iters < 1 || !(gap > 0 && gap <= 60000))
        usage(rank);

    size_t maxcount = (size_t)(hi / 4 > 0 ? hi / 4 : 1);
    float *buf = calloc(maxcount, sizeof(float));
    if (!buf) {
        fprintf(stderr, "mpi_gap_bench: out of memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (rank == 0) {
        printf("# mpi_gap_bench: nranks=%d  in-place float32 sum  gap_ms=%g\n", p, gap);
        printf("#%14s %12s %6s %6s %6s %12s %12s %12s %8s\n", "size(B)", "count", "type",
               "redop", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong");
        fflush(stdout);
    }
    long wrong_total = 0;
    for (long bytes = lo; bytes <= hi; bytes *= factor) {
        int count = (int)(bytes / 4 > 0 ? bytes / 4 : 1);
        long nbytes = (long)count * 4;
        memset(buf, 0, (size_t)count * sizeof(float));
        for (long i = 0; i < warmup; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double total = 0.0;
        for (long i = 0; i < iters; i++) {
            sleep_ms(gap);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            total += MPI_Wtime() - t0;
        }
        double mean = total / (double)iters, worst = 0.0;
        MPI_Reduce(&mean, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        /* Rank r holds (i % 7) + r: the sum is exact in float32. */
        for (int i = 0; i < count; i++) buf[i] = (float)(i % 7 + rank);
        MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        long bad = 0, bad_all = 0;
        for (int i = 0; i < count; i++)
            if (buf[i] != (float)((i % 7) * p + p * (p - 1) / 2)) bad++;
        MPI_Reduce(&bad, &bad_all, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (rank == 0) {
            double algbw = (double)nbytes / worst / 1e9;
            printf("%15ld %12d %6s %6s %6ld %12.2f %12.4f %12.4f %8ld\n", nbytes, count, "float",
                   "sum", iters, worst * 1e6, algbw, algbw * 2.0 * (p - 1) / p, bad_all);
            fflush(stdout);
            wrong_total += bad_all;
        }
    }
    free(buf);
    MPI_Finalize();
    return wrong_total ? 1 : 0;
}
