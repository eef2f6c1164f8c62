/*
 * chorus inside an MPI program: MPI starts the ranks and hands out the unique id, chorus
 * moves the data (as an NCCL program does with ncclGetUniqueId and MPI_Bcast).
 *
 * Build (after `ffi/install.sh --prefix "$HOME/.local"`):
 *   mpicc mpi_allreduce.c $(PKG_CONFIG_PATH=$HOME/.local/lib/pkgconfig pkg-config --cflags --libs chorus) \
 *      -Wl,-rpath,$HOME/.local/lib -o mpi_allreduce
 * Run four ranks on this machine (--oversubscribe where it has fewer than four cores;
 * --allow-run-as-root as root):
 *   mpirun -n 4 --oversubscribe ./mpi_allreduce
 *
 * No CHORUS_ADDR is needed: rank 0 makes the id (its process hosts the rendezvous), MPI
 * broadcasts it, every rank joins with it. Every rank contributes rank + i at index i, sums
 * with chorus, checks the result, and compares it with MPI_Allreduce of the same input.
 */
#include <chorus.h>
#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>

static void check(int32_t status, const char *what) {
    if (status != CHORUS_OK) {
        fprintf(stderr, "%s failed: %s (%s)\n", what, chorus_status_string(status),
                chorus_last_error());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    chorus_unique_id id;
    if (rank == 0) check(chorus_get_unique_id(&id), "chorus_get_unique_id");
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    chorus_comm *comm = NULL;
    check(chorus_comm_init_rank(&comm, size, id, rank), "chorus_comm_init_rank");

    const size_t n = 1 << 20;
    double *mine = malloc(n * sizeof *mine), *ours = malloc(n * sizeof *ours);
    double *mpis = malloc(n * sizeof *mpis);
    if (!mine || !ours || !mpis) MPI_Abort(MPI_COMM_WORLD, 1);
    for (size_t i = 0; i < n; i++) mine[i] = rank + (double)i;
    check(chorus_allreduce(comm, mine, ours, n, CHORUS_FLOAT64, CHORUS_SUM), "chorus_allreduce");
    MPI_Allreduce(mine, mpis, (int)n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);

    size_t wrong = 0, differ = 0;
    for (size_t i = 0; i < n; i++) {
        double want = (double)size * (size - 1) / 2 + (double)size * (double)i;
        wrong += ours[i] != want;
        differ += ours[i] != mpis[i];
    }
    printf("rank %d of %d: %zu elements, %zu wrong, %zu differ from MPI_Allreduce\n", rank, size,
           n, wrong, differ);
    check(chorus_comm_destroy(comm), "chorus_comm_destroy");
    free(mine);
    free(ours);
    free(mpis);
    MPI_Finalize();
    return wrong || differ ? 1 : 0;
}
