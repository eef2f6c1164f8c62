/*
 * mpi_coll_bench.c - Open MPI's broadcast, reduce, allgather, reduce-scatter and all-to-all
 * beside `chorus-perf <collective>`: float32, sum, out of place, sizes as chorus-perf counts
 * them (per rank for broadcast and reduce, the whole p-block buffer for the others), sizes
 * MINBYTES..MAXBYTES by factors of 4, 5 warm-up calls, then ITERS timed calls; prints
 * "COLL BYTES US BUSBW_GBps" with the slowest rank's mean time per call and nccl-tests' bus
 * bandwidth factor (1 for broadcast and reduce, (p-1)/p for the others). No data check: a
 * timing companion, not a test.
 *
 *   mpicc -O2 mpi_coll_bench.c -o mpi_coll_bench
 *   mpirun -n P ./mpi_coll_bench COLL MINBYTES MAXBYTES ITERS
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, p;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p);
    const char *coll = argv[1];
    size_t lo = strtoull(argv[2], 0, 10), hi = strtoull(argv[3], 0, 10);
    int iters = atoi(argv[4]);
    char *a = malloc(hi * 2 + 64), *b = malloc(hi * 2 + 64);
    memset(a, 1, hi * 2 + 64);
    memset(b, 0, hi * 2 + 64);
    for (size_t s = lo; s <= hi; s *= 4) {
        size_t n = s / 4; /* floats */
        size_t blk = n / p;
        double factor = 1.0;
        for (int it = -5; it < iters; it++) {
            if (it == 0) { MPI_Barrier(MPI_COMM_WORLD); }
            static double t0;
            if (it == 0) t0 = MPI_Wtime();
            if (!strcmp(coll, "broadcast")) MPI_Bcast(a, (int)n, MPI_FLOAT, 0, MPI_COMM_WORLD);
            else if (!strcmp(coll, "reduce")) MPI_Reduce(a, b, (int)n, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
            else if (!strcmp(coll, "allgather")) MPI_Allgather(a, (int)blk, MPI_FLOAT, b, (int)blk, MPI_FLOAT, MPI_COMM_WORLD);
            else if (!strcmp(coll, "reduce_scatter")) MPI_Reduce_scatter_block(a, b, (int)blk, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (!strcmp(coll, "alltoall")) MPI_Alltoall(a, (int)blk, MPI_FLOAT, b, (int)blk, MPI_FLOAT, MPI_COMM_WORLD);
            if (it == iters - 1) {
                double t = (MPI_Wtime() - t0) / iters, tmax;
                MPI_Reduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
                if (!strcmp(coll, "allgather") || !strcmp(coll, "reduce_scatter") || !strcmp(coll, "alltoall"))
                    factor = (double)(p - 1) / p;
                size_t bytes = (!strcmp(coll, "broadcast") || !strcmp(coll, "reduce")) ? n * 4 : blk * p * 4;
                if (rank == 0) printf("%s %zu %.1f %.3f\n", coll, bytes, tmax * 1e6, bytes / tmax * factor / 1e9);
            }
        }
    }
    free(a); free(b);
    MPI_Finalize();
    return 0;
}
