/*
 * Allreduce from C with chorus.
 *
 * Build (after `ffi/install.sh --prefix "$HOME/.local"`):
 *   cc allreduce.c $(PKG_CONFIG_PATH=$HOME/.local/lib/pkgconfig pkg-config --cflags --libs chorus) \
 *      -Wl,-rpath,$HOME/.local/lib -o allreduce
 * Run four ranks on this machine:
 *   chorus-run -n 4 ./allreduce
 *
 * Every rank contributes rank + i at index i; every rank ends with the sum, which it checks.
 */
#include <chorus.h>

#include <stdio.h>
#include <stdlib.h>

/* Print what failed and why, and stop this rank. */
static void check(int32_t status, const char *what) {
    if (status != CHORUS_OK) {
        fprintf(stderr, "%s failed: %s (%s)\n", what, chorus_status_string(status),
                chorus_last_error());
        exit(1);
    }
}

int main(void) {
    chorus_comm *comm = NULL;
    int rank, size;
    check(chorus_comm_init_env(&comm), "chorus_comm_init_env");
    check(chorus_comm_rank(comm, &rank), "chorus_comm_rank");
    check(chorus_comm_size(comm, &size), "chorus_comm_size");

    enum { N = 1024 };
    float *grad = malloc(N * sizeof *grad);
    if (grad == NULL) return 1;
    for (int i = 0; i < N; i++) grad[i] = (float)(rank + i);

    /* In place: the send and receive buffers are the same. */
    check(chorus_allreduce(comm, grad, grad, N, CHORUS_FLOAT32, CHORUS_SUM), "chorus_allreduce");

    int wrong = 0;
    for (int i = 0; i < N; i++)
        if (grad[i] != (float)(size * (size - 1) / 2 + size * i)) wrong++;
    printf("rank %d of %d: grad[0] = %g, grad[%d] = %g, %d wrong (chorus %s)\n", rank, size,
           grad[0], N - 1, grad[N - 1], wrong, chorus_version());

    check(chorus_barrier(comm), "chorus_barrier");
    chorus_comm_destroy(comm);
    free(grad);
    return wrong == 0 ? 0 : 1;
}
