/*
 * Tests of the chorus C ABI. ffi/tests/c_api.rs compiles this file with the system C compiler
 * and runs it as every rank of a job (CHORUS_* in the environment, rank 0 hosts the store).
 *
 *   api_test sweep            every dtype x op x count, in place and out of place, checked
 *   api_test collectives      broadcast, reduce, allgather, reduce_scatter, alltoall, gather,
 *                             scatter, send/recv on every dtype, in place and out of place;
 *                             sendrecv around a ring of 4 MiB messages (a copy on one rank);
 *                             p2p batches: 4 MiB to both neighbours and to itself at once,
 *                             and one of two dtypes
 *                             allgatherv, alltoallv, reduce_scatterv, gatherv and scatterv with
 *                             blocks of different sizes; scan and exscan
 *   api_test badargs          NULL / bad enum / overflow / overlap / bad options: each refused
 *                             with CHORUS_INVALID_ARGUMENT and the communicator still usable
 *   api_test mismatch KIND    the last rank calls with another count / dtype / op / collective
 *                             (KIND = count | dtype | op | collective | nonblocking | held: the
 *                             last rank's first is refused for a transfer it holds): every rank gets an
 *                             error (mismatch, remote or timeout), then the communicator refuses
 *                             further calls
 *   api_test peer_exit        the last rank exits without a word: the others get an error
 *   api_test peer_abort       the last rank aborts: the others get an error naming it
 *   api_test split            split by parity ranked in reverse, one rank without a color, dup:
 *                             membership, order and collectives on each new communicator, the
 *                             parent still usable, freed in either order; bad arguments
 *   api_test uniqueid         rank 0 makes a unique id, broadcasts it over the first communicator
 *                             (as MPI_Bcast would), every rank joins a second one through it
 *                             and runs an allreduce on it; a garbled id and bad ranks refused
 *   api_test transfers        chorus_isend/chorus_irecv: a ring of 4 MiB sends issued before
 *                             their receives, waited in reverse; messages to itself; a
 *                             blocking recv among live transfers; collectives refused while
 *                             transfers are live (the communicator still usable), allowed on a
 *                             dup meanwhile; a transfer whose request was freed, finished by
 *                             chorus_comm_destroy; bad arguments
 *   api_test busy             2 ranks: while a thread of rank 0 waits in a call for rank 1,
 *                             destroying (or aborting) the communicator or the compressor it
 *                             uses is refused with CHORUS_INVALID_USAGE, and works after
 *
 * Each rank prints "status <code> <name>" for the error cases and "ok <mode>" at the end;
 * any failed check prints "FAIL ..." and exits 1.
 */
#include <chorus.h>

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <threads.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

static int g_rank = -1, g_size = -1;

#define CHECK(cond, ...)                                                                      \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "FAIL rank %d line %d: ", g_rank, __LINE__);                      \
            fprintf(stderr, __VA_ARGS__);                                                     \
            fprintf(stderr, "\n");                                                            \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

/* The call must succeed. */
#define OK(call)                                                                              \
    do {                                                                                      \
        int32_t st_ = (call);                                                                 \
        CHECK(st_ == CHORUS_OK, "%s -> %d (%s): %s", #call, (int)st_,                         \
              chorus_status_string(st_), chorus_last_error());                                \
        CHECK(chorus_last_error()[0] == '\0', "%s: last error set after success", #call);     \
    } while (0)

/* The call must fail with `want` and leave a message. */
#define EXPECT(call, want)                                                                    \
    do {                                                                                      \
        int32_t st_ = (call);                                                                 \
        CHECK(st_ == (want), "%s -> %d (%s), want %d: %s", #call, (int)st_,                   \
              chorus_status_string(st_), (int)(want), chorus_last_error());                   \
        CHECK(strlen(chorus_last_error()) > 0, "%s: no last error message", #call);           \
    } while (0)

/* ---- element access for every dtype (values used here are small and exact) ---- */

static int is_float(chorus_dtype dt) {
    return dt == CHORUS_FLOAT16 || dt == CHORUS_FLOAT32 || dt == CHORUS_FLOAT64 ||
           dt == CHORUS_BFLOAT16;
}

/* binary16 bits of v, which must be 0 or a normal binary16 value. */
static uint16_t half_bits(double v) {
    if (v == 0) return 0;
    uint16_t sign = v < 0 ? 0x8000 : 0;
    int e;
    double m = frexp(fabs(v), &e); /* |v| = m * 2^e, m in [0.5, 1) */
    return (uint16_t)(sign | (uint16_t)((e - 1 + 15) << 10) | (uint16_t)((m * 2 - 1) * 1024));
}

static double half_value(uint16_t h) {
    int e = (h >> 10) & 0x1f, f = h & 0x3ff;
    double v = e == 0 ? ldexp(f, -24) : e == 31 ? (f ? NAN : INFINITY) : ldexp(1024 + f, e - 25);
    return (h & 0x8000) ? -v : v;
}

static uint16_t bf16_bits(double v) {
    float f = (float)v;
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16); /* exact for the values used here */
}

static double bf16_value(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A negative value goes to an unsigned type through int64_t (a negative double converted to
 * an unsigned type is undefined in C; -1 becomes all ones, as a sentinel should). */
#define UNSIGNED(T, v) ((v) < 0 ? (T)(int64_t)(v) : (T)(v))

static void store(chorus_dtype dt, void *p, size_t i, double v) {
    switch (dt) {
    case CHORUS_INT8: ((int8_t *)p)[i] = (int8_t)v; break;
    case CHORUS_UINT8: ((uint8_t *)p)[i] = UNSIGNED(uint8_t, v); break;
    case CHORUS_INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    case CHORUS_UINT32: ((uint32_t *)p)[i] = UNSIGNED(uint32_t, v); break;
    case CHORUS_INT64: ((int64_t *)p)[i] = (int64_t)v; break;
    case CHORUS_UINT64: ((uint64_t *)p)[i] = UNSIGNED(uint64_t, v); break;
    case CHORUS_FLOAT16: ((uint16_t *)p)[i] = half_bits(v); break;
    case CHORUS_FLOAT32: ((float *)p)[i] = (float)v; break;
    case CHORUS_FLOAT64: ((double *)p)[i] = v; break;
    case CHORUS_BFLOAT16: ((uint16_t *)p)[i] = bf16_bits(v); break;
    }
}

static double load(chorus_dtype dt, const void *p, size_t i) {
    switch (dt) {
    case CHORUS_INT8: return ((const int8_t *)p)[i];
    case CHORUS_UINT8: return ((const uint8_t *)p)[i];
    case CHORUS_INT32: return ((const int32_t *)p)[i];
    case CHORUS_UINT32: return ((const uint32_t *)p)[i];
    case CHORUS_INT64: return (double)((const int64_t *)p)[i];
    case CHORUS_UINT64: return (double)((const uint64_t *)p)[i];
    case CHORUS_FLOAT16: return half_value(((const uint16_t *)p)[i]);
    case CHORUS_FLOAT32: return ((const float *)p)[i];
    case CHORUS_FLOAT64: return ((const double *)p)[i];
    case CHORUS_BFLOAT16: return bf16_value(((const uint16_t *)p)[i]);
    }
    return NAN;
}

/* Input of rank r at index i: 1, 2 or 3, so that sums, products (3^4 = 81 fits in int8),
 * maxima, minima and averages are exact in every dtype for up to 4 ranks. */
static double input(int r, size_t i) { return (double)(1 + (i + 2 * (size_t)r) % 3); }

static double expected(chorus_dtype dt, chorus_op op, size_t i) {
    double acc = input(0, i);
    for (int r = 1; r < g_size; r++) {
        double x = input(r, i);
        switch (op) {
        case CHORUS_SUM: case CHORUS_AVG: acc += x; break;
        case CHORUS_PROD: acc *= x; break;
        case CHORUS_MAX: acc = x > acc ? x : acc; break;
        case CHORUS_MIN: acc = x < acc ? x : acc; break;
        }
    }
    if (op == CHORUS_AVG) acc = is_float(dt) ? acc / g_size : floor(acc / g_size);
    return acc;
}

/* ---- modes ---- */

static void sweep(chorus_comm *comm) {
    static const size_t counts[] = {0, 1, 7, 1000, 65537};
    size_t max = 65537 * 8;
    unsigned char *send = malloc(max), *recv = malloc(max);
    CHECK(send && recv, "out of memory");
    int calls = 0;
    for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
        size_t n = counts[c];
        for (int d = CHORUS_INT8; d <= CHORUS_BFLOAT16; d++) {
            chorus_dtype dt = (chorus_dtype)d;
            for (int o = CHORUS_SUM; o <= CHORUS_AVG; o++) {
                chorus_op op = (chorus_op)o;
                for (int inplace = 0; inplace < 2; inplace++) {
                    for (size_t i = 0; i < n; i++) {
                        store(dt, send, i, input(g_rank, i));
                        store(dt, recv, i, -1);
                    }
                    void *rb = inplace ? send : recv;
                    if (n == 0) {
                        /* NULL buffers are fine for an empty call. */
                        OK(chorus_allreduce(comm, NULL, inplace ? NULL : recv, 0, dt, op));
                    } else if (++calls % 7 == 0) {
                        chorus_options o = CHORUS_OPTIONS_INIT;
                        o.algorithm = "ring";
                        o.timeout_seconds = 60;
                        OK(chorus_allreduce_opts(comm, send, rb, n, dt, op, &o));
                    } else {
                        OK(chorus_allreduce(comm, send, rb, n, dt, op));
                    }
                    for (size_t i = 0; i < n; i++) {
                        double got = load(dt, rb, i), want = expected(dt, op, i);
                        CHECK(got == want, "p=%d dtype %d op %d count %zu inplace %d: [%zu] = %g, want %g",
                              g_size, d, o, n, inplace, i, got, want);
                    }
                }
            }
        }
        OK(chorus_barrier(comm));
    }
    free(send);
    free(recv);
}

/* Every other collective on every dtype, in place and out of place, checked exactly. */
static void collectives(chorus_comm *comm) {
    const size_t n = 5; /* elements per block */
    const int p = g_size, me = g_rank;
    size_t all = n * (size_t)p;
    unsigned char *a = malloc(all * 8), *b = malloc(all * 8);
    CHECK(a && b, "out of memory");
    for (int d = CHORUS_INT8; d <= CHORUS_BFLOAT16; d++) {
        chorus_dtype dt = (chorus_dtype)d;
        size_t es = (d <= CHORUS_UINT8) ? 1 : (d == CHORUS_FLOAT16 || d == CHORUS_BFLOAT16) ? 2
                  : (d == CHORUS_INT32 || d == CHORUS_UINT32 || d == CHORUS_FLOAT32) ? 4 : 8;
        int root = p - 1;
#define FILL(buf, count, expr) for (size_t i = 0; i < (count); i++) store(dt, buf, i, (expr))
#define VERIFY(buf, count, expr, what)                                                         \
    for (size_t i = 0; i < (count); i++)                                                       \
        CHECK(load(dt, buf, i) == (expr), "%s dtype %d [%zu] = %g, want %g", what, d, i,       \
              load(dt, buf, i), (double)(expr))
        /* broadcast from the last rank */
        FILL(a, n, me == root ? (double)(i + 1) : 0.0);
        OK(chorus_broadcast(comm, a, n, dt, root));
        VERIFY(a, n, (double)(i + 1), "broadcast");
        /* reduce (sum) to rank 0, out of place and in place */
        FILL(a, n, input(me, i));
        FILL(b, n, -1.0);
        OK(chorus_reduce(comm, a, me == 0 ? b : NULL, n, dt, CHORUS_SUM, 0));
        if (me == 0) VERIFY(b, n, expected(dt, CHORUS_SUM, i), "reduce");
        OK(chorus_reduce(comm, a, a, n, dt, CHORUS_MAX, 0));
        if (me == 0) VERIFY(a, n, expected(dt, CHORUS_MAX, i), "reduce in place");
        /* allgather: block j holds j + i + 1 */
        FILL(a, n, (double)(me + i + 1));
        OK(chorus_allgather(comm, a, b, n, dt));
        VERIFY(b, all, (double)(i / n + i % n + 1), "allgather");
        FILL(b, all, (i / n == (size_t)me) ? (double)(me + i % n + 1) : 0.0);
        OK(chorus_allgather(comm, b + (size_t)me * n * es, b, n, dt));
        VERIFY(b, all, (double)(i / n + i % n + 1), "allgather in place");
        /* reduce_scatter (sum): every rank sends input(r, i); block me of the sum */
        FILL(a, all, input(me, i));
        OK(chorus_reduce_scatter(comm, a, b, n, dt, CHORUS_SUM));
        VERIFY(b, n, expected(dt, CHORUS_SUM, (size_t)me * n + i), "reduce_scatter");
        OK(chorus_reduce_scatter(comm, a, a + (size_t)me * n * es, n, dt, CHORUS_SUM));
        VERIFY(a + (size_t)me * n * es, n, expected(dt, CHORUS_SUM, (size_t)me * n + i),
               "reduce_scatter in place");
        /* alltoall: block j of rank r holds r + j + i%n + 1 -> block r of rank j */
        FILL(a, all, (double)(me + i / n + i % n + 1));
        OK(chorus_alltoall(comm, a, b, n, dt));
        VERIFY(b, all, (double)(i / n + me + i % n + 1), "alltoall");
        OK(chorus_alltoall(comm, a, a, n, dt));
        VERIFY(a, all, (double)(i / n + me + i % n + 1), "alltoall in place");
        /* gather to the last rank, scatter from it */
        FILL(a, n, (double)(me + i + 1));
        OK(chorus_gather(comm, a, me == root ? b : NULL, n, dt, root));
        if (me == root) VERIFY(b, all, (double)(i / n + i % n + 1), "gather");
        FILL(a, all, (double)(i / n + i % n + 1));
        FILL(b, n, 0.0);
        OK(chorus_scatter(comm, me == root ? a : NULL, b, n, dt, root));
        VERIFY(b, n, (double)(me + i + 1), "scatter");
        /* send/recv around a ring: even ranks send first */
        if (p > 1) {
            int right = (me + 1) % p, left = (me + p - 1) % p;
            FILL(a, n, (double)(me + i + 1));
            if (me % 2 == 0) {
                OK(chorus_send(comm, a, n, dt, right));
                OK(chorus_recv(comm, b, n, dt, left));
            } else {
                OK(chorus_recv(comm, b, n, dt, left));
                OK(chorus_send(comm, a, n, dt, right));
            }
            VERIFY(b, n, (double)(left + i + 1), "send/recv");
        }
#undef FILL
#undef VERIFY
    }
    /* Bad arguments of these calls: refused before anything is sent. */
    EXPECT(chorus_broadcast(comm, a, n, CHORUS_FLOAT32, -1), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_broadcast(comm, a, n, CHORUS_FLOAT32, p), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_broadcast(comm, NULL, n, CHORUS_FLOAT32, 0), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_reduce(comm, a, b, n, CHORUS_FLOAT32, (chorus_op)9, 0), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allgather(comm, a, a + 1, n, CHORUS_FLOAT32), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allgather(comm, a, b, SIZE_MAX / 2, CHORUS_FLOAT32), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_reduce_scatter(comm, a, NULL, n, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_alltoall(comm, a, b, n, (chorus_dtype)77), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_send(comm, a, n, CHORUS_FLOAT32, me), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_recv(comm, b, n, CHORUS_FLOAT32, -3), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_gather(comm, a, b, n, CHORUS_FLOAT32, p + 5), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_sendrecv(comm, a, n, me, a + 4, n, me, CHORUS_FLOAT32), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_sendrecv(comm, NULL, n, me, b, n, me, CHORUS_FLOAT32), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_sendrecv(comm, a, n, -1, b, n, me, CHORUS_FLOAT32), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_sendrecv(comm, a, n, me, b, n + 1, me, CHORUS_FLOAT32), CHORUS_MISMATCH);
    OK(chorus_barrier(comm));
    free(a);
    free(b);

    /* allgatherv and alltoallv with blocks of different sizes (zeros included). */
    {
        size_t *rc = malloc((size_t)p * sizeof(size_t)), *sc = malloc((size_t)p * sizeof(size_t));
        /* Blocks of at most 3 elements: 3p in and out at most. */
        int32_t *in = malloc(3 * (size_t)p * 4 + 4), *out = malloc(3 * (size_t)p * 4 + 4);
        CHECK(rc && sc && in && out, "out of memory");
        size_t total = 0, at = 0;
        for (int j = 0; j < p; j++) {
            rc[j] = (size_t)((j * 3 + 1) % 4);
            if (j < me) at += rc[j];
            total += rc[j];
        }
        for (size_t i = 0; i < rc[me]; i++) in[i] = me * 100 + (int32_t)i;
        OK(chorus_allgatherv(comm, in, out, rc, NULL, CHORUS_INT32));
        for (int j = 0, k = 0; j < p; j++)
            for (size_t i = 0; i < rc[j]; i++, k++)
                CHECK(out[k] == j * 100 + (int32_t)i, "allgatherv [%d] = %d", k, out[k]);
        /* in place: this rank's block already at its place */
        for (size_t i = 0; i < total; i++) out[i] = -1;
        for (size_t i = 0; i < rc[me]; i++) out[at + i] = me * 100 + (int32_t)i;
        if (rc[me] > 0) OK(chorus_allgatherv(comm, out + at, out, rc, NULL, CHORUS_INT32));
        else OK(chorus_allgatherv(comm, in, out, rc, NULL, CHORUS_INT32));
        for (int j = 0, k = 0; j < p; j++)
            for (size_t i = 0; i < rc[j]; i++, k++)
                CHECK(out[k] == j * 100 + (int32_t)i, "allgatherv in place [%d] = %d", k, out[k]);
        /* alltoallv: rank r sends (r + 2j) % 4 values to rank j */
        size_t sn = 0, rn = 0;
        for (int j = 0; j < p; j++) {
            sc[j] = (size_t)((me + 2 * j) % 4);
            rc[j] = (size_t)((j + 2 * me) % 4);
            sn += sc[j];
            rn += rc[j];
        }
        for (int j = 0, k = 0; j < p; j++)
            for (size_t i = 0; i < sc[j]; i++, k++) in[k] = me * 1000 + j * 10 + (int32_t)i;
        OK(chorus_alltoallv(comm, in, sc, NULL, out, rc, NULL, CHORUS_INT32));
        for (int j = 0, k = 0; j < p; j++)
            for (size_t i = 0; i < rc[j]; i++, k++)
                CHECK(out[k] == j * 1000 + me * 10 + (int32_t)i, "alltoallv [%d] = %d", k, out[k]);
        /* bad arguments: NULL counts, overlapping buffers, a self count that differs */
        EXPECT(chorus_allgatherv(comm, in, out, NULL, NULL, CHORUS_INT32), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_alltoallv(comm, in, sc, NULL, out, NULL, NULL, CHORUS_INT32), CHORUS_INVALID_ARGUMENT);
        if (sn > 0 && rn > 0)
            EXPECT(chorus_alltoallv(comm, in, sc, NULL, in, rc, NULL, CHORUS_INT32), CHORUS_INVALID_ARGUMENT);
        sc[me] += 1;
        EXPECT(chorus_alltoallv(comm, in, sc, NULL, out, rc, NULL, CHORUS_INT32), CHORUS_INVALID_ARGUMENT);
        {
            /* ... refused when issued too, nonblocking */
            chorus_request *vr = NULL;
            EXPECT(chorus_ialltoallv(comm, in, sc, NULL, out, rc, NULL, CHORUS_INT32, &vr), CHORUS_INVALID_ARGUMENT);
            CHECK(vr == NULL, "a refused ialltoallv set its request");
            CHECK(strstr(chorus_last_error(), "sendcounts") != NULL, "message: %s", chorus_last_error());
        }
        /* gatherv and scatterv to and from the last rank: rank j's block of (j + 2) % 4
         * values (zeros included); counts only on the root, NULL elsewhere */
        {
            const int root = p - 1;
            size_t total = 0;
            for (int j = 0; j < p; j++) total += (size_t)((j + 2) % 4);
            size_t mine = (size_t)((me + 2) % 4);
            int32_t blk[3], got[3] = {-1, -1, -1}, *all = malloc(total * 4 + 4);
            size_t *gc = malloc((size_t)p * sizeof(size_t));
            CHECK(all && gc, "out of memory");
            for (int j = 0; j < p; j++) gc[j] = (size_t)((j + 2) % 4);
            for (size_t i = 0; i < mine; i++) blk[i] = me * 10 + (int32_t)i;
            OK(chorus_gatherv(comm, blk, mine, me == root ? all : NULL, me == root ? gc : NULL,
                              NULL, CHORUS_INT32, root));
            if (me == root)
                for (int j = 0, k = 0; j < p; j++)
                    for (size_t i = 0; i < gc[j]; i++, k++)
                        CHECK(all[k] == j * 10 + (int)i, "gatherv [%d] = %d", k, all[k]);
            if (me == root)
                for (int j = 0, k = 0; j < p; j++)
                    for (size_t i = 0; i < gc[j]; i++, k++) all[k] = j * 100 + (int32_t)i;
            OK(chorus_scatterv(comm, me == root ? all : NULL, me == root ? gc : NULL, NULL, got,
                               mine, CHORUS_INT32, root));
            for (size_t i = 0; i < mine; i++)
                CHECK(got[i] == me * 100 + (int)i, "scatterv [%zu] = %d", i, got[i]);
            /* A root without counts is refused. A refusal takes the call's place in the order
             * of collectives, as a call that ran: every rank makes it (on a duplicate, whose
             * blocks sent to the refusing root are dropped with it). */
            chorus_comm *probe = NULL;
            OK(chorus_comm_dup(comm, &probe));
            if (me == root)
                EXPECT(chorus_gatherv(probe, blk, mine, all, NULL, NULL, CHORUS_INT32, root),
                       CHORUS_INVALID_ARGUMENT);
            else
                OK(chorus_gatherv(probe, blk, mine, NULL, NULL, NULL, CHORUS_INT32, root));
            OK(chorus_comm_destroy(probe));
            /* A root whose own count disagrees with its entry of the counts: refused when the
             * nonblocking call is issued (found when it ran, a freed request's error would
             * abort the communicator). */
            OK(chorus_comm_dup(comm, &probe));
            size_t wrong = mine == 0 ? 1 : mine - 1;
            for (int which = 0; which < 2; which++) {
                if (me == root) {
                    chorus_request *rq = NULL;
                    int32_t st2 =
                        which == 0
                            ? chorus_igatherv(probe, blk, wrong, all, gc, NULL, CHORUS_INT32, root, &rq)
                            : chorus_iscatterv(probe, all, gc, NULL, got, wrong, CHORUS_INT32, root, &rq);
                    EXPECT(st2, CHORUS_INVALID_ARGUMENT);
                    CHECK(rq == NULL, "a refused call set its request");
                    CHECK(strstr(chorus_last_error(), "own block") != NULL, "message: %s",
                          chorus_last_error());
                } else if (which == 0) {
                    OK(chorus_gatherv(probe, blk, mine, NULL, NULL, NULL, CHORUS_INT32, root));
                }
            }
            OK(chorus_comm_destroy(probe));
            /* A root refused while the others' reduce went out does not take their data as its
             * next reduce's result: that call fails (a mismatch) instead. */
            OK(chorus_comm_dup(comm, &probe));
            int32_t one[2] = {1, 1}, res[2] = {0, 0};
            if (me == root)
                EXPECT(chorus_reduce(probe, one, NULL, 2, CHORUS_INT32, CHORUS_SUM, root),
                       CHORUS_INVALID_ARGUMENT);
            else
                OK(chorus_reduce(probe, one, NULL, 2, CHORUS_INT32, CHORUS_SUM, root));
            int st = chorus_reduce(probe, one, res, 2, CHORUS_INT32, CHORUS_SUM, root);
            if (me == root && p > 1)
                CHECK(st != CHORUS_OK, "the root took the refused call's data: %d %d", res[0],
                      res[1]);
            OK(chorus_comm_destroy(probe));
            /* The same with a NULL request on the root only: a bad request is refused as the
             * call's other arguments are, taking the call's place. */
            OK(chorus_comm_dup(comm, &probe));
            if (me == root) {
                EXPECT(chorus_ireduce(probe, one, res, 2, CHORUS_INT32, CHORUS_SUM, root, NULL),
                       CHORUS_INVALID_ARGUMENT);
            } else {
                chorus_request *rq = NULL;
                OK(chorus_ireduce(probe, one, NULL, 2, CHORUS_INT32, CHORUS_SUM, root, &rq));
                (void)chorus_wait(&rq); /* the root may have aborted by then */
            }
            res[0] = res[1] = 0;
            st = chorus_reduce(probe, one, res, 2, CHORUS_INT32, CHORUS_SUM, root);
            if (me == root && p > 1)
                CHECK(st != CHORUS_OK, "the root took the refused ireduce's data: %d %d", res[0],
                      res[1]);
            OK(chorus_comm_destroy(probe));
            /* Any refusal takes the call's place, not only an invalid argument: options of a
             * newer header (CHORUS_UNSUPPORTED) on one rank only. Its next allreduce must not
             * complete with the others' refused one. */
            if (p > 1) {
                OK(chorus_comm_dup(comm, &probe));
                struct {
                    chorus_options v1;
                    uint64_t newer_field;
                } newer = {CHORUS_OPTIONS_INIT, 1};
                newer.v1.size = sizeof newer;
                int32_t two[2] = {2, 2};
                res[0] = res[1] = 0;
                if (me == root) {
                    EXPECT(chorus_allreduce_opts(probe, one, res, 2, CHORUS_INT32, CHORUS_SUM,
                                                 &newer.v1),
                           CHORUS_UNSUPPORTED);
                    st = chorus_allreduce(probe, two, res, 2, CHORUS_INT32, CHORUS_SUM);
                } else {
                    st = chorus_allreduce(probe, one, res, 2, CHORUS_INT32, CHORUS_SUM);
                }
                CHECK(st != CHORUS_OK, "an allreduce completed with a refused one: %d %d",
                      res[0], res[1]);
                OK(chorus_comm_destroy(probe));
            }
            OK(chorus_barrier(comm));
            free(all);
            free(gc);
        }
        /* The same with MPI's displacements: rank j's block of (j + 1) % 3 values (zeros
         * included) at displs[j], the blocks in reverse rank order with a gap of 2 before
         * each; the gaps keep their -5. The root of gatherv/scatterv is rank 0. */
        {
            size_t *cnt = malloc((size_t)p * sizeof(size_t)), *dsp = malloc((size_t)p * sizeof(size_t));
            size_t *zero = calloc((size_t)p, sizeof(size_t));
            CHECK(cnt && dsp && zero, "out of memory");
            size_t len = 0;
            for (int j = p - 1; j >= 0; j--) {
                cnt[j] = (size_t)((j + 1) % 3);
                len += 2;
                dsp[j] = len;
                len += cnt[j];
            }
            /* an empty block's displacement is ignored, as in MPI: any value will do */
            for (int j = 0; j < p; j++)
                if (cnt[j] == 0) dsp[j] = SIZE_MAX;
            int32_t *buf = malloc(len * 4), *want = malloc(len * 4), mine[2], got[2] = {-1, -1};
            CHECK(buf && want, "out of memory");
            for (size_t i = 0; i < len; i++) buf[i] = want[i] = -5;
            for (int j = 0; j < p; j++)
                for (size_t i = 0; i < cnt[j]; i++) want[dsp[j] + i] = j * 100 + (int32_t)i;
            for (size_t i = 0; i < cnt[me]; i++) mine[i] = me * 100 + (int32_t)i;
            OK(chorus_allgatherv(comm, mine, buf, cnt, dsp, CHORUS_INT32));
            for (size_t i = 0; i < len; i++) CHECK(buf[i] == want[i], "allgatherv displs [%zu] = %d", i, buf[i]);
            /* in place: this rank's block already at its displacement */
            for (size_t i = 0; i < len; i++) buf[i] = -5;
            for (size_t i = 0; i < cnt[me]; i++) buf[dsp[me] + i] = mine[i];
            OK(chorus_allgatherv(comm, cnt[me] ? buf + dsp[me] : mine, buf, cnt, dsp, CHORUS_INT32));
            for (size_t i = 0; i < len; i++) CHECK(buf[i] == want[i], "allgatherv displs in place [%zu]", i);
            /* gatherv into the layout on rank 0; scatterv back out of it */
            for (size_t i = 0; i < len; i++) buf[i] = -5;
            OK(chorus_gatherv(comm, mine, cnt[me], me == 0 ? buf : NULL, me == 0 ? cnt : NULL,
                              me == 0 ? dsp : NULL, CHORUS_INT32, 0));
            if (me == 0)
                for (size_t i = 0; i < len; i++) CHECK(buf[i] == want[i], "gatherv displs [%zu] = %d", i, buf[i]);
            OK(chorus_scatterv(comm, me == 0 ? want : NULL, me == 0 ? cnt : NULL, me == 0 ? dsp : NULL,
                               got, cnt[me], CHORUS_INT32, 0));
            for (size_t i = 0; i < cnt[me]; i++) CHECK(got[i] == mine[i], "scatterv displs [%zu] = %d", i, got[i]);
            /* alltoallv: every rank sends the same value block (j + 1) % 3 values long to rank
             * j, all read from offset 0 (overlapping send blocks), into the reversed layout */
            int32_t src[2] = {me * 7, me * 7 + 1};
            size_t *rc2 = malloc((size_t)p * sizeof(size_t));
            CHECK(rc2 != NULL, "out of memory");
            for (int j = 0; j < p; j++) rc2[j] = cnt[me];
            size_t rlen = 0;
            for (int j = p - 1; j >= 0; j--) { dsp[j] = rlen + 1; rlen += 1 + rc2[j]; }
            int32_t *rb = malloc((rlen + 1) * 4);
            CHECK(rb != NULL, "out of memory");
            for (size_t i = 0; i <= rlen; i++) rb[i] = -5;
            OK(chorus_alltoallv(comm, src, cnt, zero, rb, rc2, dsp, CHORUS_INT32));
            for (int j = 0; j < p; j++) {
                CHECK(rb[dsp[j] - 1] == -5, "alltoallv displs gap before %d", j);
                for (size_t i = 0; i < rc2[j]; i++)
                    CHECK(rb[dsp[j] + i] == j * 7 + (int32_t)i, "alltoallv displs from %d [%zu] = %d", j, i, rb[dsp[j] + i]);
            }
            /* overlapping receive blocks are refused, the communicator usable */
            if (p > 1) {
                for (int j = 0; j < p; j++) { cnt[j] = 2; dsp[j] = 0; }
                int32_t big[16];
                EXPECT(chorus_allgatherv(comm, mine, big, cnt, dsp, CHORUS_INT32), CHORUS_INVALID_ARGUMENT);
                EXPECT(chorus_gatherv(comm, mine, 2, big, cnt, dsp, CHORUS_INT32, me), CHORUS_INVALID_ARGUMENT);
                /* ... also a nonblocking one, at once (its request would fail later) */
                chorus_request *vr = NULL;
                EXPECT(chorus_iallgatherv(comm, mine, big, cnt, dsp, CHORUS_INT32, &vr), CHORUS_INVALID_ARGUMENT);
                CHECK(vr == NULL, "a refused iallgatherv set its request");
                CHECK(strstr(chorus_last_error(), "overlap") != NULL, "message: %s", chorus_last_error());
            }
            OK(chorus_barrier(comm));
            free(rb);
            free(rc2);
            free(buf);
            free(want);
            free(cnt);
            free(dsp);
            free(zero);
        }
        /* reduce_scatterv: block j of (3j + 1) % 4 values (zeros included; all 2 in the
         * second round: equal blocks); rank r's value i of block j is (r + 1)(i + j + 1) */
        for (int round = 0; round < 2; round++) {
            size_t all = 0, at = 0;
            for (int j = 0; j < p; j++) {
                rc[j] = round == 0 ? (size_t)((j * 3 + 1) % 4) : 2;
                if (j < me) at += rc[j];
                all += rc[j];
            }
            int64_t *x = malloc(all * 8 + 8), *y = malloc(all * 8 + 8);
            CHECK(x && y, "out of memory");
            for (int j = 0, k = 0; j < p; j++)
                for (size_t i = 0; i < rc[j]; i++, k++) x[k] = (int64_t)(me + 1) * (int64_t)(i + (size_t)j + 1);
            const int64_t sum = (int64_t)p * (p + 1) / 2;
            OK(chorus_reduce_scatterv(comm, x, y, rc, CHORUS_INT64, CHORUS_SUM));
            for (size_t i = 0; i < rc[me]; i++)
                CHECK(y[i] == sum * (int64_t)(i + (size_t)me + 1), "reduce_scatterv [%zu] = %lld", i,
                      (long long)y[i]);
            /* in place: recvbuf is this rank's block of sendbuf */
            if (rc[me] > 0) {
                OK(chorus_reduce_scatterv(comm, x, x + at, rc, CHORUS_INT64, CHORUS_SUM));
                for (size_t i = 0; i < rc[me]; i++)
                    CHECK(x[at + i] == sum * (int64_t)(i + (size_t)me + 1), "reduce_scatterv in place [%zu]", i);
            } else {
                OK(chorus_reduce_scatterv(comm, x, y, rc, CHORUS_INT64, CHORUS_SUM));
            }
            /* bad arguments, refused on every rank alike: NULL counts; (equal blocks, so no
             * rank's is empty) a receive buffer overlapping sendbuf off its own block */
            EXPECT(chorus_reduce_scatterv(comm, x, y, NULL, CHORUS_INT64, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
            if (round == 1)
                EXPECT(chorus_reduce_scatterv(comm, x, (char *)x + 1, rc, CHORUS_INT64, CHORUS_SUM),
                       CHORUS_INVALID_ARGUMENT);
            free(x);
            free(y);
        }
        OK(chorus_barrier(comm));
        free(rc);
        free(sc);
        free(in);
        free(out);
    }

    /* scan and exscan: rank r's value i is r + i + 1; sums of ranks 0..=r (0..r), max too */
    {
        enum { S = 5 };
        int64_t x[S], y[S];
        double d[S];
        for (int i = 0; i < S; i++) x[i] = me + i + 1, y[i] = -1, d[i] = (double)(me * (i + 1));
        OK(chorus_scan(comm, x, y, S, CHORUS_INT64, CHORUS_SUM));
        for (int i = 0; i < S; i++)
            CHECK(y[i] == (int64_t)(me + 1) * (me + 2 * i + 2) / 2, "scan [%d] = %lld", i, (long long)y[i]);
        for (int i = 0; i < S; i++) y[i] = -1;
        OK(chorus_exscan(comm, x, y, S, CHORUS_INT64, CHORUS_SUM));
        for (int i = 0; i < S; i++)
            CHECK(y[i] == (me == 0 ? -1 : (int64_t)me * (me + 2 * i + 1) / 2), "exscan [%d] = %lld", i,
                  (long long)y[i]);
        OK(chorus_scan(comm, d, d, S, CHORUS_FLOAT64, CHORUS_MAX)); /* in place */
        for (int i = 0; i < S; i++) CHECK(d[i] == (double)(me * (i + 1)), "scan max [%d] = %g", i, d[i]);
        EXPECT(chorus_scan(comm, x, y, S, CHORUS_INT64, CHORUS_AVG), CHORUS_INVALID_ARGUMENT);
        /* Nonblocking: refused when issued (found when it ran, a freed request's error would
         * abort the communicator), the request left NULL. */
        {
            chorus_request *nb = NULL;
            EXPECT(chorus_iscan(comm, x, y, S, CHORUS_INT64, CHORUS_AVG, &nb), CHORUS_INVALID_ARGUMENT);
            CHECK(nb == NULL, "iscan avg: a request was made");
            EXPECT(chorus_iallreduce(comm, d, d, S, CHORUS_FLOAT64, CHORUS_BAND, NULL, &nb),
                   CHORUS_INVALID_ARGUMENT);
            CHECK(nb == NULL, "iallreduce band of doubles: a request was made");
        }
        EXPECT(chorus_exscan(comm, x, x + 1, 3, CHORUS_INT64, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
        OK(chorus_barrier(comm));
    }

    /* sendrecv around a ring with messages far larger than any transport buffers (4 MiB):
     * every rank sends first, which blocking sends could not do; with one rank, a copy. */
    {
        const size_t m = (size_t)1 << 20;
        int32_t *s = malloc(m * 4), *r = malloc(m * 4);
        CHECK(s && r, "out of memory");
        int right = (me + 1) % p, left = (me + p - 1) % p;
        for (size_t i = 0; i < m; i++) s[i] = (int32_t)(me * 7 + (int)(i % 1000));
        OK(chorus_sendrecv(comm, s, m, right, r, m, left, CHORUS_INT32));
        for (size_t i = 0; i < m; i++)
            CHECK(r[i] == (int32_t)(left * 7 + (int)(i % 1000)), "sendrecv [%zu] = %d", i, r[i]);

        /* A batch: the same 4 MiB buffer to both neighbours and a short message to itself,
         * the receives posted after every send (blocking sends could not), then a batch of
         * two dtypes whose receives come first (in the order that pairs them with the sends
         * when left and right are one rank, or this rank). */
        int32_t *r2 = malloc(m * 4);
        CHECK(r2, "out of memory");
        double to_self = 2.5 + me, from_self = 0;
        chorus_p2p_op ops[6] = {
            {s, m, CHORUS_INT32, left, CHORUS_P2P_SEND},
            {s, m, CHORUS_INT32, right, CHORUS_P2P_SEND},
            {&to_self, 1, CHORUS_FLOAT64, me, CHORUS_P2P_SEND},
            {r, m, CHORUS_INT32, left, CHORUS_P2P_RECV},
            {r2, m, CHORUS_INT32, right, CHORUS_P2P_RECV},
            {&from_self, 1, CHORUS_FLOAT64, me, CHORUS_P2P_RECV},
        };
        memset(r, 0, m * 4);
        OK(chorus_p2p_batch(comm, ops, 6));
        for (size_t i = 0; i < m; i++) {
            CHECK(r[i] == (int32_t)(left * 7 + (int)(i % 1000)), "batch from left [%zu] = %d", i, r[i]);
            CHECK(r2[i] == (int32_t)(right * 7 + (int)(i % 1000)), "batch from right [%zu] = %d", i, r2[i]);
        }
        CHECK(from_self == 2.5 + me, "batch to itself: %g", from_self);
        uint16_t h_out = (uint16_t)(100 + me), h_in = 0;
        int64_t l_out[3] = {me, -me, 1LL << 40}, l_in[3] = {0};
        chorus_p2p_op mixed[4] = {
            {l_in, 3, CHORUS_INT64, right, CHORUS_P2P_RECV},
            {&h_in, 1, CHORUS_FLOAT16, left, CHORUS_P2P_RECV},
            {l_out, 3, CHORUS_INT64, left, CHORUS_P2P_SEND},
            {&h_out, 1, CHORUS_FLOAT16, right, CHORUS_P2P_SEND},
        };
        OK(chorus_p2p_batch(comm, mixed, 4));
        CHECK(h_in == (uint16_t)(100 + left), "batch float16 bits %u", h_in);
        CHECK(l_in[0] == right && l_in[1] == -right && l_in[2] == 1LL << 40, "batch int64 %lld",
              (long long)l_in[0]);
        OK(chorus_p2p_batch(comm, NULL, 0));
        free(r2);
        free(s);
        free(r);
    }
}

static void badargs(chorus_comm *comm) {
    float a[8] = {0}, b[8] = {0};
    int x = -1;

    /* Status names: fixed, distinct, never NULL. */
    for (int s = 0; s <= 8; s++) {
        CHECK(strcmp(chorus_status_string(s), "unknown status") != 0, "status %d unnamed", s);
        for (int t = 0; t < s; t++)
            CHECK(strcmp(chorus_status_string(s), chorus_status_string(t)) != 0,
                  "statuses %d and %d share a name", s, t);
    }
    CHECK(strcmp(chorus_status_string(9), "unknown status") == 0, "status 9");
    CHECK(strcmp(chorus_status_string(-1), "unknown status") == 0, "status -1");
    const char *want_version = getenv("CHORUS_EXPECT_VERSION");
    CHECK(want_version && strcmp(chorus_version(), want_version) == 0, "version %s",
          chorus_version());

    /* NULL pointers. */
    EXPECT(chorus_allreduce(NULL, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce(comm, NULL, b, 8, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce(comm, a, NULL, 8, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce(comm, NULL, NULL, 8, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_barrier(NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_rank(NULL, &x), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_rank(comm, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_size(NULL, &x), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_size(comm, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_abort(NULL), CHORUS_INVALID_ARGUMENT);
    OK(chorus_comm_destroy(NULL));

    /* Bad enums. */
    EXPECT(chorus_allreduce(comm, a, b, 8, (chorus_dtype)10, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "dtype") != NULL, "message: %s", chorus_last_error());
    EXPECT(chorus_allreduce(comm, a, b, 8, (chorus_dtype)-1, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce(comm, a, b, 8, CHORUS_FLOAT32, (chorus_op)8), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "op") != NULL, "message: %s", chorus_last_error());
    /* Bitwise operators: integers only (as MPI), and they combine bits. */
    EXPECT(chorus_allreduce(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_BAND), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "bitwise") != NULL, "message: %s", chorus_last_error());
    int32_t bits = 1 << g_rank;
    OK(chorus_allreduce(comm, &bits, &bits, 1, CHORUS_INT32, CHORUS_BOR));
    CHECK(bits == (1 << g_size) - 1, "bor of 1 << rank: %d", (int)bits);
    uint8_t parity = (uint8_t)(g_rank + 1);
    OK(chorus_allreduce(comm, &parity, &parity, 1, CHORUS_UINT8, CHORUS_BXOR));
    uint8_t want_parity = 0;
    for (int r = 0; r < g_size; r++) want_parity ^= (uint8_t)(r + 1);
    CHECK(parity == want_parity, "bxor: %d, want %d", parity, want_parity);
    EXPECT(chorus_allreduce(comm, a, b, 8, CHORUS_FLOAT32, (chorus_op)INT32_MIN),
           CHORUS_INVALID_ARGUMENT);

    /* Sizes that do not fit in memory; overlapping buffers. */
    EXPECT(chorus_allreduce(comm, a, b, SIZE_MAX, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce(comm, a, b, SIZE_MAX / 2, CHORUS_UINT8, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce(comm, a, a + 1, 4, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "overlap") != NULL, "message: %s", chorus_last_error());

    /* Options. */
    chorus_options o = CHORUS_OPTIONS_INIT;
    o.size = 0;
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o), CHORUS_INVALID_ARGUMENT);
    o.size = sizeof o - 1;
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o), CHORUS_INVALID_ARGUMENT);
    o.size = (size_t)-1;
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o), CHORUS_INVALID_ARGUMENT);
    chorus_options o2 = CHORUS_OPTIONS_INIT;
    o2.algorithm = "no-such-algorithm";
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o2), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "no-such-algorithm") != NULL, "message: %s", chorus_last_error());
    o2.algorithm = "\xff\xfe";
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o2), CHORUS_INVALID_ARGUMENT);
    chorus_options o3 = CHORUS_OPTIONS_INIT;
    o3.timeout_seconds = -1;
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o3), CHORUS_INVALID_ARGUMENT);
    o3.timeout_seconds = NAN;
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o3), CHORUS_INVALID_ARGUMENT);
    o3.timeout_seconds = 1e-12; /* would time out before it began */
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &o3), CHORUS_INVALID_ARGUMENT);
    /* A struct from a newer header: unknown fields zero is fine, set is unsupported. */
    struct {
        chorus_options v1;
        uint64_t newer_field;
    } big = {CHORUS_OPTIONS_INIT, 0};
    big.v1.size = sizeof big;
    big.newer_field = 1;
    EXPECT(chorus_allreduce_opts(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM, &big.v1), CHORUS_UNSUPPORTED);

    /* Batches of sends and receives: each refused whole, before anything moves. */
    {
        int next = (g_rank + 1) % g_size;
        chorus_p2p_op ops[2] = {
            {a, 4, CHORUS_FLOAT32, next, CHORUS_P2P_SEND},
            {b, 4, CHORUS_FLOAT32, next, CHORUS_P2P_RECV},
        };
        EXPECT(chorus_p2p_batch(comm, NULL, 2), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_p2p_batch(NULL, ops, 2), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_p2p_batch(comm, ops, SIZE_MAX), CHORUS_INVALID_ARGUMENT);
        ops[1].kind = (chorus_p2p_kind)2;
        EXPECT(chorus_p2p_batch(comm, ops, 2), CHORUS_INVALID_ARGUMENT);
        CHECK(strstr(chorus_last_error(), "ops[1].kind") != NULL, "message: %s", chorus_last_error());
        ops[1].kind = CHORUS_P2P_RECV;
        ops[0].dtype = (chorus_dtype)12;
        EXPECT(chorus_p2p_batch(comm, ops, 2), CHORUS_INVALID_ARGUMENT);
        CHECK(strstr(chorus_last_error(), "ops[0].dtype") != NULL, "message: %s", chorus_last_error());
        ops[0].dtype = CHORUS_FLOAT32;
        ops[0].peer = g_size;
        EXPECT(chorus_p2p_batch(comm, ops, 2), CHORUS_INVALID_ARGUMENT);
        ops[0].peer = -1;
        EXPECT(chorus_p2p_batch(comm, ops, 2), CHORUS_INVALID_ARGUMENT);
        ops[0].peer = next;
        ops[1].buf = NULL;
        EXPECT(chorus_p2p_batch(comm, ops, 2), CHORUS_INVALID_ARGUMENT);
        ops[1].buf = a + 2; /* the receive overlaps the send */
        EXPECT(chorus_p2p_batch(comm, ops, 2), CHORUS_INVALID_ARGUMENT);
        CHECK(strstr(chorus_last_error(), "overlap") != NULL, "message: %s", chorus_last_error());
        ops[1].buf = b;
        ops[1].count = SIZE_MAX / 2;
        EXPECT(chorus_p2p_batch(comm, ops, 2), CHORUS_INVALID_ARGUMENT);
        /* A send to itself needs its receive, of the same length. */
        chorus_p2p_op self[2] = {
            {a, 4, CHORUS_FLOAT32, g_rank, CHORUS_P2P_SEND},
            {b, 3, CHORUS_FLOAT32, g_rank, CHORUS_P2P_RECV},
        };
        EXPECT(chorus_p2p_batch(comm, self, 1), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_p2p_batch(comm, self, 2), CHORUS_INVALID_ARGUMENT);
        chorus_request *req = (chorus_request *)a;
        EXPECT(chorus_ip2p_batch(comm, self, 2, &req), CHORUS_INVALID_ARGUMENT);
        CHECK(req == NULL, "a refused batch left *request set");
        EXPECT(chorus_ip2p_batch(comm, self, 2, NULL), CHORUS_INVALID_ARGUMENT);
        self[1].count = 4;
        OK(chorus_ip2p_batch(comm, self, 2, &req));
        OK(chorus_wait(&req));
        /* A batch refused on one rank only takes no place among the collectives: the next
         * collective matches the others'. */
        if (g_rank == 0) EXPECT(chorus_p2p_batch(comm, self, 1), CHORUS_INVALID_ARGUMENT);
        OK(chorus_barrier(comm));
    }

    /* Init arguments (no communication happens). */
    chorus_comm *other = (chorus_comm *)&x; /* must be reset to NULL on failure */
    EXPECT(chorus_comm_init(NULL, 0, 1, "127.0.0.1:0", NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init(&other, -1, 2, "127.0.0.1:1", NULL), CHORUS_INVALID_ARGUMENT);
    CHECK(other == NULL, "out not reset on failure");
    EXPECT(chorus_comm_init(&other, 2, 2, "127.0.0.1:1", NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init(&other, 0, 0, "127.0.0.1:1", NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init(&other, 1, 2, NULL, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init(&other, 1, 2, "no port here", NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init(&other, 0, 1, "127.0.0.1:0", "\xff"), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init_env(NULL), CHORUS_INVALID_ARGUMENT);
    CHECK(other == NULL, "out not NULL after failures");
    /* A group of one needs no peers and works beside the job's communicator. */
    OK(chorus_comm_init(&other, 0, 1, "127.0.0.1:0", ""));
    OK(chorus_comm_size(other, &x));
    CHECK(x == 1, "size %d", x);
    OK(chorus_comm_destroy(other));
    /* Destroyed, or never a communicator: refused by every call, not used (no double free). */
    EXPECT(chorus_comm_size(other, &x), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "not a live communicator") != NULL, "message: %s",
          chorus_last_error());
    EXPECT(chorus_barrier(other), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce(other, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_abort(other), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_destroy(other), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_rank((chorus_comm *)a, &x), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_destroy((chorus_comm *)a), CHORUS_INVALID_ARGUMENT);
    other = NULL;

    /* After all that, the communicator still works. */
    for (int i = 0; i < 8; i++) a[i] = (float)(g_rank + i);
    OK(chorus_allreduce(comm, a, b, 8, CHORUS_FLOAT32, CHORUS_SUM));
    for (int i = 0; i < 8; i++)
        CHECK(b[i] == (float)(g_size * (g_size - 1) / 2 + g_size * i), "b[%d] = %g", i, b[i]);
    OK(chorus_barrier(comm));
}

/* Compressed allreduce: every spec, float32 and float16 buffers, the report, bad input. */
static void compression(chorus_comm *comm) {
    enum { N = 4096 };
    static float a[N];
    static uint16_t h[N];
    const char *specs[] = {"fp16,min_bytes=0", "bf16,min_bytes=0", "int8,min_bytes=0",
                           "int4,min_bytes=0", "ternary,min_bytes=0", "sign,min_bytes=0",
                           "topk:0.5,min_bytes=0"};
    /* Mean error allowed, relative to the average (measured at p = 3: fp16, bf16 and sign 0,
     * int8 0.002, int4 0.032, ternary 0.22 (stochastic), top-k 0.5). */
    const double tolerance[] = {0.001, 0.001, 0.01, 0.08, 0.45, 0.001, 0.6};
    /* Bytes each spec sent: fewer bits per element, fewer bytes (so a spec is not ignored). */
    unsigned long long sent[sizeof specs / sizeof specs[0]];
    const double want = (g_size + 1) / 2.0;
    for (size_t s = 0; s < sizeof specs / sizeof specs[0]; s++) {
        chorus_compressor *c = NULL;
        OK(chorus_compressor_create(&c, specs[s]));
        CHECK(c != NULL, "create returned NULL");
        /* Rank r holds r + 1 everywhere: the average is (p + 1) / 2, which the quantizers keep
         * closely (a rank's one value is its own scale; partial sums are quantized again);
         * top-k sends half the entries at a time (the rest wait in its residual), so it is off
         * by about half. */
        for (int i = 0; i < N; i++) a[i] = (float)(g_rank + 1);
        OK(chorus_allreduce_compressed(comm, a, N, CHORUS_FLOAT32, CHORUS_AVG, c));
        double err = 0;
        for (int i = 0; i < N; i++) err += fabs(a[i] - want);
        CHECK(err / N < tolerance[s] * want, "%s: mean error %g (average %g)", specs[s], err / N,
              want);
        chorus_compression_report r = {0};
        r.size = sizeof r;
        OK(chorus_compressor_report(c, &r));
        CHECK(r.compressed == 1 && r.dense_bytes == 4 * N, "%s: report %d %llu", specs[s],
              (int)r.compressed, (unsigned long long)r.dense_bytes);
        CHECK(g_size == 1 || r.bytes_sent > 0, "%s: nothing sent", specs[s]);
        sent[s] = (unsigned long long)r.bytes_sent;
        OK(chorus_compressor_destroy(c));
    }
    if (g_size > 1) {
        /* fp16 and bf16 (16 bits) > int8 > int4 > ternary (2 bits) > sign (1 bit). */
        CHECK(sent[0] > sent[2] && sent[1] > sent[2] && sent[2] > sent[3] && sent[3] > sent[4] &&
                  sent[4] > sent[5],
              "bytes sent fp16 %llu bf16 %llu int8 %llu int4 %llu ternary %llu sign %llu", sent[0],
              sent[1], sent[2], sent[3], sent[4], sent[5]);
    }
    chorus_compressor *c = NULL;
    OK(chorus_compressor_create(&c, "int8,min_bytes=0"));
    for (int i = 0; i < N; i++) h[i] = half_bits(2.0);
    OK(chorus_allreduce_compressed(comm, h, N, CHORUS_FLOAT16, CHORUS_SUM, c));
    for (int i = 0; i < N; i++)
        CHECK(fabs(half_value(h[i]) - 2.0 * g_size) < 0.05 * g_size, "h[%d] = %g", i, half_value(h[i]));
    /* A newer header's larger report: the known fields filled, the rest zeroed, size kept. */
    struct {
        chorus_compression_report known;
        uint64_t newer[3];
    } big;
    memset(&big, 0xAB, sizeof big);
    big.known.size = sizeof big;
    OK(chorus_compressor_report(c, &big.known));
    CHECK(big.known.size == sizeof big, "size field changed to %zu", big.known.size);
    CHECK(big.known.compressed == 1 && big.known.dense_bytes == 4 * N, "report %d %llu",
          (int)big.known.compressed, (unsigned long long)big.known.dense_bytes);
    for (int i = 0; i < 3; i++) CHECK(big.newer[i] == 0, "unknown field %d not zeroed", i);
    /* Bad input: a clear status, the communicator still usable. */
    chorus_compressor *none = NULL;
    EXPECT(chorus_compressor_create(&none, "int3"), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "int3") != NULL, "message: %s", chorus_last_error());
    EXPECT(chorus_compressor_create(&none, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_compressor_create(NULL, "int8"), CHORUS_INVALID_ARGUMENT);
    CHECK(none == NULL, "out set on failure");
    EXPECT(chorus_allreduce_compressed(comm, a, N, CHORUS_INT32, CHORUS_SUM, c), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce_compressed(comm, a, N, CHORUS_FLOAT32, CHORUS_MAX, c), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce_compressed(comm, a, N, CHORUS_FLOAT32, 99, c), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce_compressed(comm, a, N, CHORUS_FLOAT32, CHORUS_SUM, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce_compressed(NULL, a, N, CHORUS_FLOAT32, CHORUS_SUM, c), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce_compressed(comm, NULL, N, CHORUS_FLOAT32, CHORUS_SUM, c), CHORUS_INVALID_ARGUMENT);
    chorus_compression_report bad = {0};
    EXPECT(chorus_compressor_report(c, &bad), CHORUS_INVALID_ARGUMENT);
    bad.size = 1 << 20;
    EXPECT(chorus_compressor_report(c, &bad), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_compressor_report(c, NULL), CHORUS_INVALID_ARGUMENT);
    OK(chorus_compressor_destroy(c));
    OK(chorus_compressor_destroy(NULL));
    /* Destroyed, or never a compressor: refused, not used (no double free). */
    chorus_compression_report rep = {.size = sizeof rep};
    EXPECT(chorus_compressor_destroy(c), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "not a live compressor") != NULL, "message: %s",
          chorus_last_error());
    EXPECT(chorus_compressor_report(c, &rep), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_allreduce_compressed(comm, a, N, CHORUS_FLOAT32, CHORUS_SUM, c), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_compressor_report((chorus_compressor *)a, &rep), CHORUS_INVALID_ARGUMENT);
    c = NULL;
    OK(chorus_barrier(comm));
}

static void report(int32_t st) {
    printf("status %d %s: %s\n", (int)st, chorus_status_string(st), chorus_last_error());
    fflush(stdout);
}

static void mismatch(chorus_comm *comm, const char *kind) {
    int last = g_rank == g_size - 1;
    float buf[101] = {0};
    int32_t st;
    if (strcmp(kind, "count") == 0)
        st = chorus_allreduce(comm, buf, buf, last ? 101 : 100, CHORUS_FLOAT32, CHORUS_SUM);
    else if (strcmp(kind, "dtype") == 0)
        st = chorus_allreduce(comm, buf, buf, 100, last ? CHORUS_INT32 : CHORUS_FLOAT32, CHORUS_SUM);
    else if (strcmp(kind, "op") == 0)
        st = chorus_allreduce(comm, buf, buf, 100, CHORUS_FLOAT32, last ? CHORUS_MAX : CHORUS_SUM);
    else if (strcmp(kind, "collective") == 0)
        st = last ? chorus_barrier(comm) : chorus_allreduce(comm, buf, buf, 100, CHORUS_FLOAT32, CHORUS_SUM);
    else if (strcmp(kind, "nonblocking") == 0) {
        /* The mismatch shows in the request; the call issued after it fails too. */
        chorus_request *r[2];
        OK(chorus_iallreduce(comm, buf, buf, last ? 101 : 100, CHORUS_FLOAT32, CHORUS_SUM, NULL, &r[0]));
        OK(chorus_ibarrier(comm, &r[1]));
        int32_t after = chorus_wait(&r[1]);
        CHECK(after != CHORUS_OK, "the call after a mismatch succeeded");
        st = chorus_wait(&r[0]);
    }
    else if (strcmp(kind, "held") == 0) {
        /* The last rank's allreduce is refused (it holds a transfer's request): its place
         * is used up, so its next allreduce, of the same shape, does not pair with the
         * others' first (which would give both a sum of different calls, with no error). */
        if (last) {
            chorus_request *s = NULL, *r = NULL;
            int32_t one = 1, got = 0;
            OK(chorus_isend(comm, &one, 1, CHORUS_INT32, g_rank, &s));
            EXPECT(chorus_allreduce(comm, buf, buf, 100, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_USAGE);
            OK(chorus_irecv(comm, &got, 1, CHORUS_INT32, g_rank, &r));
            OK(chorus_wait(&r));
            OK(chorus_wait(&s));
            buf[0] = 100;
        }
        st = chorus_allreduce(comm, buf, buf, 100, CHORUS_FLOAT32, CHORUS_SUM);
    }
    else {
        CHECK(0, "unknown mismatch kind %s", kind);
        return;
    }
    report(st);
    CHECK(st == CHORUS_MISMATCH || st == CHORUS_REMOTE_ERROR || st == CHORUS_TIMEOUT,
          "mismatch %s gave %d", kind, (int)st);
    /* The communicator is now unusable; abort and destroy still work. */
    EXPECT(chorus_barrier(comm), CHORUS_INVALID_USAGE);
    OK(chorus_comm_abort(comm));
    EXPECT(chorus_allreduce(comm, buf, buf, 1, CHORUS_FLOAT32, CHORUS_SUM), CHORUS_INVALID_USAGE);
}

static void peer_gone(chorus_comm *comm, int abort_it) {
    float buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = 1;
    if (g_rank == g_size - 1) {
        if (abort_it) {
            OK(chorus_comm_abort(comm));
            OK(chorus_comm_destroy(comm));
        }
        printf("ok leaving\n");
        fflush(stdout);
        exit(0); /* without destroying: the process exit closes the connections */
    }
    int32_t st = chorus_allreduce(comm, buf, buf, 1000, CHORUS_FLOAT32, CHORUS_SUM);
    report(st);
    CHECK(st == CHORUS_REMOTE_ERROR, "a lost peer gave %d, want CHORUS_REMOTE_ERROR", (int)st);
}

/* Sleep `ms` milliseconds. */
static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    thrd_sleep(&t, NULL);
}

struct busy_call {
    chorus_comm *comm;
    chorus_compressor *comp; /* NULL: a barrier; else a compressed allreduce with it */
    float *buf;
    int count;
    int32_t status;
    atomic_int calling; /* set just before the call */
};

static int busy_thread(void *arg) {
    struct busy_call *b = arg;
    atomic_store(&b->calling, 1);
    b->status = b->comp == NULL
                    ? chorus_barrier(b->comm)
                    : chorus_allreduce_compressed(b->comm, b->buf, b->count, CHORUS_FLOAT32,
                                                  CHORUS_SUM, b->comp);
    return 0;
}

static double now_s(void) {
    struct timespec t; /* C11's clock (wall time; the test measures about a second) */
    timespec_get(&t, TIME_UTC);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Wait (at most 10 s) until `b`'s thread is about to make its call, then give it 300 ms to be
 * inside (no hook says when it is; starting a thread is the slow part on a busy machine). */
static void wait_calling(struct busy_call *b) {
    double until = now_s() + 10.0;
    while (!atomic_load(&b->calling) && now_s() < until) sleep_ms(5);
    CHECK(atomic_load(&b->calling), "the thread did not start its call within 10 s");
    sleep_ms(300);
}

/* Rank 0 starts a call in a thread; rank 1 joins it 1.5 s later. Meanwhile rank 0's main
 * thread tries to free what the call uses: refused, and nothing is freed. Then calls that rank
 * 1 joins only after 3 s are aborted by rank 0's main thread at 0.8 s: a blocking one in a
 * thread, and a nonblocking one with a blocking one queued behind it. */
static void busy(chorus_comm *comm) {
    CHECK(g_size == 2, "busy runs on 2 ranks");
    enum { N = 4096 };
    static float a[N];
    chorus_compressor *c = NULL;
    OK(chorus_compressor_create(&c, "int8,min_bytes=0"));
    for (int round = 0; round < 2; round++) {
        for (int i = 0; i < N; i++) a[i] = 1.0f;
        struct busy_call b = {comm, round == 0 ? NULL : c, a, N, -1, 0};
        if (g_rank == 1) {
            sleep_ms(1500);
            busy_thread(&b);
        } else {
            thrd_t t;
            CHECK(thrd_create(&t, busy_thread, &b) == thrd_success, "thrd_create");
            wait_calling(&b);
            if (round == 0) {
                EXPECT(chorus_comm_destroy(comm), CHORUS_INVALID_USAGE);
                CHECK(strstr(chorus_last_error(), "in use") != NULL, "message: %s", chorus_last_error());
                /* nor may another call start on it, blocking or not */
                chorus_request *r = NULL;
                EXPECT(chorus_ibarrier(comm, &r), CHORUS_INVALID_USAGE);
                CHECK(r == NULL, "a refused nonblocking call set its request");
                EXPECT(chorus_barrier(comm), CHORUS_INVALID_USAGE);
            } else {
                EXPECT(chorus_compressor_destroy(c), CHORUS_INVALID_USAGE);
                CHECK(strstr(chorus_last_error(), "in use") != NULL, "message: %s", chorus_last_error());
            }
            CHECK(thrd_join(t, NULL) == thrd_success, "thrd_join");
        }
        CHECK(b.status == CHORUS_OK, "round %d: the call gave %d: %s", round, (int)b.status,
              chorus_last_error());
    }
    for (int i = 0; i < N; i++) CHECK(fabs(a[i] - 2.0) < 0.05, "a[%d] = %g", i, a[i]);
    OK(chorus_compressor_destroy(c));

    /* Abort from another thread while a blocking call waits (on a copy of the communicator). */
    chorus_comm *d = NULL;
    OK(chorus_comm_dup(comm, &d));
    struct busy_call b = {d, NULL, a, N, -1, 0};
    if (g_rank == 1) {
        sleep_ms(3000);
        /* Rank 0 entered this barrier before it aborted: it may complete. Then the next call
         * meets the abort, told by rank 0's notice. */
        busy_thread(&b);
        if (b.status == CHORUS_OK) busy_thread(&b);
        CHECK(b.status == CHORUS_REMOTE_ERROR, "rank 1's barrier on the aborted copy gave %d: %s",
              (int)b.status, chorus_last_error());
        CHECK(strstr(chorus_last_error(), "chorus_comm_abort called") != NULL, "message: %s",
              chorus_last_error());
    } else {
        thrd_t t;
        CHECK(thrd_create(&t, busy_thread, &b) == thrd_success, "thrd_create");
        wait_calling(&b);
        double t0 = now_s();
        OK(chorus_comm_abort(d));
        CHECK(thrd_join(t, NULL) == thrd_success, "thrd_join");
        double took = now_s() - t0;
        CHECK(b.status == CHORUS_INVALID_USAGE, "the aborted barrier gave %d", (int)b.status);
        CHECK(took < 1.5, "the aborted barrier ended %.2f s after the abort", took);
    }
    OK(chorus_comm_destroy(d));

    /* Abort while a nonblocking barrier runs on the communicator's thread and a thread's
     * blocking barrier waits behind it: destroy is refused meanwhile (a call is inside), abort
     * goes through, and both calls fail at once. */
    chorus_request *r = NULL;
    struct busy_call q = {comm, NULL, a, N, -1, 0};
    if (g_rank == 1) {
        sleep_ms(3000);
        /* As above: the barrier rank 0 entered may complete; then the next one meets the
         * abort. */
        OK(chorus_ibarrier(comm, &r));
        int32_t first = chorus_wait(&r);
        if (first == CHORUS_OK) {
            busy_thread(&q);
            first = q.status;
        }
        CHECK(first == CHORUS_REMOTE_ERROR, "rank 1's barrier after the abort gave %d: %s",
              (int)first, chorus_last_error());
        CHECK(strstr(chorus_last_error(), "chorus_comm_abort called") != NULL, "message: %s",
              chorus_last_error());
    } else {
        OK(chorus_ibarrier(comm, &r));
        thrd_t t;
        CHECK(thrd_create(&t, busy_thread, &q) == thrd_success, "thrd_create");
        wait_calling(&q);
        EXPECT(chorus_comm_destroy(comm), CHORUS_INVALID_USAGE);
        double t0 = now_s();
        OK(chorus_comm_abort(comm));
        EXPECT(chorus_wait(&r), CHORUS_INVALID_USAGE);
        CHECK(strstr(chorus_last_error(), "aborted") != NULL, "message: %s", chorus_last_error());
        CHECK(thrd_join(t, NULL) == thrd_success, "thrd_join");
        double took = now_s() - t0;
        CHECK(q.status == CHORUS_INVALID_USAGE, "the queued barrier gave %d", (int)q.status);
        CHECK(took < 1.5, "the aborted calls ended %.2f s after the abort", took);
    }
}

/* The parent ranks of `c`'s members in its rank order (an allgather on `c` itself). */
static void members_of(chorus_comm *c, int parent_rank, int *rank, int *size, int32_t *out) {
    OK(chorus_comm_rank(c, rank));
    OK(chorus_comm_size(c, size));
    int32_t mine = parent_rank;
    OK(chorus_allgather(c, &mine, out, 1, CHORUS_INT32));
}

/* Returns the half, which main uses again after freeing the parent. */
static chorus_comm *split(chorus_comm *comm) {
    const int me = g_rank, p = g_size;
    int r = -1, n = -1;
    int32_t got[4], want[4];

    /* By parity, ranked in reverse (key -rank). */
    chorus_comm *half = NULL;
    OK(chorus_comm_split(comm, me % 2, -me, &half));
    CHECK(half != NULL, "no communicator for color %d", me % 2);
    int wn = 0;
    for (int j = p - 1; j >= 0; j--)
        if (j % 2 == me % 2) want[wn++] = j;
    members_of(half, me, &r, &n, got);
    CHECK(n == wn, "size %d, want %d", n, wn);
    CHECK(want[r] == me, "rank %d in the half holds parent rank %d", r, want[r]);
    for (int j = 0; j < n; j++) CHECK(got[j] == want[j], "member %d is %d, want %d", j, got[j], want[j]);
    double sum = me, want_sum = 0;
    for (int j = 0; j < wn; j++) want_sum += want[j];
    OK(chorus_allreduce(half, &sum, &sum, 1, CHORUS_FLOAT64, CHORUS_SUM));
    CHECK(sum == want_sum, "sum over the half %g, want %g", sum, want_sum);

    /* Rank 0 joins nothing; the others one group in their order. */
    chorus_comm *rest = (chorus_comm *)&r; /* must be overwritten */
    OK(chorus_comm_split(comm, me == 0 ? CHORUS_SPLIT_NOCOLOR : 5, 0, &rest));
    if (me == 0) {
        CHECK(rest == NULL, "no color gave a communicator");
    } else {
        CHECK(rest != NULL, "color 5 gave no communicator");
        members_of(rest, me, &r, &n, got);
        CHECK(n == p - 1 && r == me - 1, "rank %d of %d", r, n);
        for (int j = 0; j < n; j++) CHECK(got[j] == j + 1, "member %d is %d", j, got[j]);
    }

    /* The host group: every rank of this job runs on this host. */
    chorus_comm *host = NULL;
    OK(chorus_comm_split_host(comm, &host));
    members_of(host, me, &r, &n, got);
    CHECK(r == me && n == p, "the host group has rank %d of %d", r, n);
    OK(chorus_comm_destroy(host));
    EXPECT(chorus_comm_split_host(comm, NULL), CHORUS_INVALID_ARGUMENT);

    /* A copy, freed first; the parent still works between and after. */
    chorus_comm *copy = NULL;
    OK(chorus_comm_dup(comm, &copy));
    CHECK(copy != NULL, "dup gave NULL");
    members_of(copy, me, &r, &n, got);
    CHECK(r == me && n == p, "the copy has rank %d of %d", r, n);
    for (int j = 0; j < n; j++) CHECK(got[j] == j, "copy member %d is %d", j, got[j]);
    int64_t v = me + 1;
    OK(chorus_allreduce(comm, &v, &v, 1, CHORUS_INT64, CHORUS_SUM));
    CHECK(v == (int64_t)p * (p + 1) / 2, "parent sum %lld", (long long)v);
    OK(chorus_comm_destroy(copy));
    OK(chorus_barrier(comm));

    /* A bad color on the last rank only: refused there, and the others fail at once too,
     * naming it: CHORUS_MISMATCH, not the CHORUS_TIMEOUT that waiting would give. */
    chorus_comm *out = half;
    int32_t st = chorus_comm_split(comm, me == p - 1 ? -2 : 0, 0, &out);
    int32_t want_st = me == p - 1 ? CHORUS_INVALID_ARGUMENT : CHORUS_MISMATCH;
    CHECK(st == want_st, "split with a bad color on rank %d: %d (%s), want %d: %s", p - 1,
          (int)st, chorus_status_string(st), (int)want_st, chorus_last_error());
    CHECK(out == NULL, "a refused split left *newcomm set");
    CHECK(strstr(chorus_last_error(), "color") != NULL, "message: %s", chorus_last_error());
    OK(chorus_barrier(comm));
    /* Nowhere to put the result on the last rank only (dup, then split_host): refused there
     * inside the exchange, so the others fail at once too, naming it. */
    /* Then a misaligned newcomm (dup), refused alike. */
    chorus_comm *slots[2] = {NULL, NULL};
    chorus_comm **misaligned = (chorus_comm **)((char *)slots + 1);
    for (int which = 0; which < 3; which++) {
        chorus_comm **dest = me != p - 1 ? &out : which == 2 ? misaligned : NULL;
        out = half;
        st = which == 1 ? chorus_comm_split_host(comm, dest) : chorus_comm_dup(comm, dest);
        CHECK(st == want_st, "%s with a bad newcomm on rank %d: %d (%s), want %d: %s",
              which == 1 ? "split_host" : "dup", p - 1, (int)st, chorus_status_string(st),
              (int)want_st, chorus_last_error());
        CHECK(me == p - 1 || out == NULL, "a refused split left *newcomm set");
        CHECK(strstr(chorus_last_error(), me == p - 1 ? "nowhere to put" : "refused") != NULL,
              "message: %s", chorus_last_error());
        OK(chorus_barrier(comm));
    }
    /* Bad pointers on every rank alike: refused everywhere. */
    EXPECT(chorus_comm_split(comm, 0, 0, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_split(NULL, 0, 0, &out), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_dup(NULL, &out), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_dup(comm, NULL), CHORUS_INVALID_ARGUMENT);
    OK(chorus_barrier(comm));

    if (rest) OK(chorus_comm_destroy(rest));
    return half;
}

static void uniqueid(chorus_comm *comm) {
    chorus_unique_id id;
    memset(&id, 0, sizeof id);
    if (g_rank == 0) OK(chorus_get_unique_id(&id));
    OK(chorus_broadcast(comm, &id, sizeof id, CHORUS_UINT8, 0));
    chorus_comm *second = NULL;
    OK(chorus_comm_init_rank(&second, g_size, id, g_rank));
    CHECK(second != NULL, "init_rank gave NULL");
    int r = -1, n = -1;
    OK(chorus_comm_rank(second, &r));
    OK(chorus_comm_size(second, &n));
    CHECK(r == g_rank && n == g_size, "rank %d of %d", r, n);
    int64_t v[3] = {g_rank, 1, -g_rank};
    OK(chorus_allreduce(second, v, v, 3, CHORUS_INT64, CHORUS_SUM));
    int64_t p = g_size;
    CHECK(v[0] == p * (p - 1) / 2 && v[1] == p && v[2] == -v[0], "sums %lld %lld %lld",
          (long long)v[0], (long long)v[1], (long long)v[2]);
    OK(chorus_comm_destroy(second));
    /* Refused before any rendezvous. */
    chorus_comm *out = comm;
    chorus_unique_id garbled = id;
    garbled.internal[0] ^= 1;
    EXPECT(chorus_comm_init_rank(&out, g_size, garbled, g_rank), CHORUS_INVALID_ARGUMENT);
    CHECK(out == NULL, "a refused init left *out set");
    CHECK(strstr(chorus_last_error(), "unique id") != NULL, "message: %s", chorus_last_error());
    EXPECT(chorus_comm_init_rank(&out, g_size, id, g_size), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init_rank(&out, 0, id, 0), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_init_rank(NULL, g_size, id, g_rank), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_get_unique_id(NULL), CHORUS_INVALID_ARGUMENT);
    OK(chorus_barrier(comm));
}

/* Nonblocking calls: every collective issued back to back (a blocking allreduce among them),
 * polled with chorus_test and completed with chorus_waitall, exact against the references;
 * bad arguments refused at issue with *request NULL; a request outliving its communicator. */
static void nonblocking(chorus_comm *comm) {
    const int p = g_size, me = g_rank, root = p - 1;
    enum { N = 5, BIG = 300001 };
    size_t all = (size_t)N * (size_t)p;
    int32_t *sum_in = malloc(BIG * 4), *sum_out = malloc(BIG * 4);
    int32_t *bc = malloc(N * 4), *red = malloc(N * 4), *ag = malloc(all * 4);
    int32_t *rs_in = malloc(all * 4), *rs_out = malloc(N * 4), *a2a = malloc(all * 4);
    int32_t *ga = malloc(all * 4), *sc_in = malloc(all * 4), *sc_out = malloc(N * 4);
    int32_t *agv = malloc(3 * (size_t)p * 4 + 4), *a2av_in = malloc(3 * (size_t)p * 4 + 4);
    int32_t *a2av_out = malloc(3 * (size_t)p * 4 + 4);
    size_t *rc = malloc((size_t)p * sizeof(size_t)), *sc = malloc((size_t)p * sizeof(size_t));
    size_t *rc2 = malloc((size_t)p * sizeof(size_t));
    CHECK(sum_in && sum_out && bc && red && ag && rs_in && rs_out && a2a && ga && sc_in &&
          sc_out && agv && a2av_in && a2av_out && rc && sc && rc2, "out of memory");
    for (int round = 0; round < 3; round++) {
        chorus_request *req[18];
        int k = 0;
        for (size_t i = 0; i < BIG; i++) sum_in[i] = (int32_t)((size_t)me * 3 + i % 7 + round);
        OK(chorus_iallreduce(comm, sum_in, sum_out, BIG, CHORUS_INT32, CHORUS_SUM, NULL, &req[k++]));
        for (int i = 0; i < N; i++) bc[i] = me == root ? 10 * i + round : -1;
        OK(chorus_ibroadcast(comm, bc, N, CHORUS_INT32, root, &req[k++]));
        for (int i = 0; i < N; i++) red[i] = me + i;
        OK(chorus_ireduce(comm, red, red, N, CHORUS_INT32, CHORUS_MAX, 0, &req[k++]));
        /* A blocking call among them runs after those issued before it. */
        int32_t one = 1;
        OK(chorus_allreduce(comm, &one, &one, 1, CHORUS_INT32, CHORUS_SUM));
        CHECK(one == p, "blocking allreduce among nonblocking ones gave %d", (int)one);
        int32_t mine[N];
        for (int i = 0; i < N; i++) mine[i] = me * 100 + i;
        OK(chorus_iallgather(comm, mine, ag, N, CHORUS_INT32, &req[k++]));
        for (size_t i = 0; i < all; i++) rs_in[i] = (int32_t)(me + (int)i);
        OK(chorus_ireduce_scatter(comm, rs_in, rs_out, N, CHORUS_INT32, CHORUS_SUM, &req[k++]));
        for (size_t i = 0; i < all; i++) a2a[i] = (int32_t)(me * 1000 + (int)i);
        OK(chorus_ialltoall(comm, a2a, a2a, N, CHORUS_INT32, &req[k++]));
        OK(chorus_igather(comm, mine, me == root ? ga : NULL, N, CHORUS_INT32, root, &req[k++]));
        for (size_t i = 0; i < all; i++) sc_in[i] = (int32_t)(7 * i);
        OK(chorus_iscatter(comm, me == root ? sc_in : NULL, sc_out, N, CHORUS_INT32, root, &req[k++]));
        size_t total = 0;
        for (int j = 0; j < p; j++) {
            rc[j] = (size_t)((j * 3 + 1 + round) % 4);
            total += rc[j];
            sc[j] = (size_t)((me + 2 * j) % 4);
            rc2[j] = (size_t)((j + 2 * me) % 4);
        }
        int32_t vin[3];
        for (size_t i = 0; i < rc[me]; i++) vin[i] = me * 100 + (int32_t)i;
        OK(chorus_iallgatherv(comm, vin, agv, rc, NULL, CHORUS_INT32, &req[k++]));
        /* The counts are read at issue: scribbling on them afterwards changes nothing. */
        size_t saved[4];
        for (int j = 0; j < p; j++) saved[j] = rc[j], rc[j] = 99;
        for (int j = 0, m = 0; j < p; j++)
            for (size_t i = 0; i < sc[j]; i++, m++) a2av_in[m] = me * 1000 + j * 10 + (int32_t)i;
        OK(chorus_ialltoallv(comm, a2av_in, sc, NULL, a2av_out, rc2, NULL, CHORUS_INT32, &req[k++]));
        /* A batch around the ring; its array is read at issue, so scribbling on it
         * afterwards changes nothing. */
        int32_t ring_out[N], ring_in[N];
        for (int i = 0; i < N; i++) ring_out[i] = me * 10 + i + round, ring_in[i] = -1;
        chorus_p2p_op ring[2] = {
            {ring_out, N, CHORUS_INT32, (me + 1) % p, CHORUS_P2P_SEND},
            {ring_in, N, CHORUS_INT32, (me + p - 1) % p, CHORUS_P2P_RECV},
        };
        OK(chorus_ip2p_batch(comm, ring, 2, &req[k++]));
        memset(ring, 0xff, sizeof ring);
        /* reduce_scatterv: block j of j + 1 values; its counts are read at issue */
        size_t rsv_counts[4];
        int32_t rsv_in[10], rsv_out[4];
        for (int j = 0, m = 0; j < p; j++) {
            rsv_counts[j] = (size_t)j + 1;
            for (int i = 0; i <= j; i++, m++) rsv_in[m] = me + i + round;
        }
        OK(chorus_ireduce_scatterv(comm, rsv_in, rsv_out, rsv_counts, CHORUS_INT32, CHORUS_MAX, &req[k++]));
        memset(rsv_counts, 0, sizeof rsv_counts);
        /* scan, then exscan in place: sums of ranks 0..=r and 0..r of me + round */
        int64_t sc_x = me + round, sc_y = -1, ex = me + round;
        OK(chorus_iscan(comm, &sc_x, &sc_y, 1, CHORUS_INT64, CHORUS_SUM, &req[k++]));
        OK(chorus_iexscan(comm, &ex, &ex, 1, CHORUS_INT64, CHORUS_SUM, &req[k++]));
        /* gatherv to rank 0 and scatterv from it: rank j's block of j + 1 values */
        int32_t gv_in[4], gv_all[10], sv_out[4];
        for (int i = 0; i <= me; i++) gv_in[i] = me * 10 + i + round;
        for (int j = 0; j < p; j++) rsv_counts[j] = (size_t)j + 1;
        OK(chorus_igatherv(comm, gv_in, (size_t)me + 1, gv_all, me == 0 ? rsv_counts : NULL, NULL,
                           CHORUS_INT32, 0, &req[k++]));
        OK(chorus_iscatterv(comm, gv_all, me == 0 ? rsv_counts : NULL, NULL, sv_out, (size_t)me + 1,
                            CHORUS_INT32, 0, &req[k++]));
        memset(rsv_counts, 0, sizeof rsv_counts);
        OK(chorus_ibarrier(comm, &req[k++]));
        /* Poll the last one (bounded), then complete everything. */
        int done = 0;
        for (int polls = 0; !done && polls < 20000; polls++) {
            chorus_request *probe = req[k - 1];
            OK(chorus_test(&req[k - 1], &done));
            if (!done) {
                CHECK(req[k - 1] == probe, "chorus_test changed a request still running");
                sleep_ms(1);
            }
        }
        CHECK(done && req[k - 1] == NULL, "the last request not done after polling");
        OK(chorus_waitall((size_t)k, req));
        for (int i = 0; i < k; i++) CHECK(req[i] == NULL, "request %d not cleared", i);
        for (size_t i = 0; i < BIG; i++) {
            int32_t want = 0;
            for (int r = 0; r < p; r++) want += (int32_t)((size_t)r * 3 + i % 7 + round);
            CHECK(sum_out[i] == want, "iallreduce [%zu] = %d, want %d", i, sum_out[i], want);
        }
        for (int i = 0; i < N; i++) CHECK(bc[i] == 10 * i + round, "ibroadcast [%d] = %d", i, bc[i]);
        if (me == 0)
            for (int i = 0; i < N; i++) CHECK(red[i] == p - 1 + i, "ireduce [%d] = %d", i, red[i]);
        for (size_t i = 0; i < all; i++)
            CHECK(ag[i] == (int32_t)(i / N * 100 + i % N), "iallgather [%zu] = %d", i, ag[i]);
        for (int i = 0; i < N; i++) {
            int32_t want = 0;
            for (int r = 0; r < p; r++) want += r + me * N + i;
            CHECK(rs_out[i] == want, "ireduce_scatter [%d] = %d, want %d", i, rs_out[i], want);
        }
        for (size_t i = 0; i < all; i++)
            CHECK(a2a[i] == (int32_t)(i / N * 1000 + (size_t)me * N + i % N), "ialltoall [%zu] = %d", i, a2a[i]);
        if (me == root)
            for (size_t i = 0; i < all; i++)
                CHECK(ga[i] == (int32_t)(i / N * 100 + i % N), "igather [%zu] = %d", i, ga[i]);
        for (int i = 0; i < N; i++)
            CHECK(sc_out[i] == (int32_t)(7 * ((size_t)me * N + i)), "iscatter [%d] = %d", i, sc_out[i]);
        for (int j = 0, m = 0; j < p; j++)
            for (size_t i = 0; i < saved[j]; i++, m++)
                CHECK(agv[m] == j * 100 + (int32_t)i, "iallgatherv [%d] = %d", m, agv[m]);
        for (int i = 0; i < N; i++)
            CHECK(ring_in[i] == ((me + p - 1) % p) * 10 + i + round, "ip2p_batch [%d] = %d", i,
                  ring_in[i]);
        for (int i = 0; i <= me; i++)
            CHECK(rsv_out[i] == p - 1 + i + round, "ireduce_scatterv [%d] = %d", i, rsv_out[i]);
        CHECK(sc_y == (int64_t)me * (me + 1) / 2 + (int64_t)(me + 1) * round, "iscan = %lld", (long long)sc_y);
        CHECK(ex == (me == 0 ? round : (int64_t)me * (me - 1) / 2 + (int64_t)me * round), "iexscan = %lld",
              (long long)ex);
        /* the scatterv sent back what the gatherv collected: each rank its own block */
        for (int i = 0; i <= me; i++)
            CHECK(sv_out[i] == me * 10 + i + round, "igatherv then iscatterv [%d] = %d", i, sv_out[i]);
        (void)total;
        for (int j = 0, m = 0; j < p; j++)
            for (size_t i = 0; i < rc2[j]; i++, m++)
                CHECK(a2av_out[m] == j * 1000 + me * 10 + (int32_t)i, "ialltoallv [%d] = %d", m, a2av_out[m]);
    }
    /* Bad arguments: refused when issued, *request NULL, nothing runs. */
    chorus_request *bad = (chorus_request *)sum_in; /* garbage that must be overwritten */
    EXPECT(chorus_iallreduce(comm, sum_in, sum_out, 4, (chorus_dtype)77, CHORUS_SUM, NULL, &bad),
           CHORUS_INVALID_ARGUMENT);
    CHECK(bad == NULL, "a refused call left *request set");
    EXPECT(chorus_iallreduce(comm, sum_in, sum_out, 4, CHORUS_INT32, CHORUS_SUM, NULL, NULL),
           CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_ibroadcast(comm, NULL, 4, CHORUS_INT32, 0, &bad), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_iallgather(comm, sum_in, sum_in + 1, 4, CHORUS_INT32, &bad), CHORUS_INVALID_ARGUMENT);
    /* A root out of range is refused when issued (found when the call ran, it would abort the
     * communicator had the request been freed unwaited). */
    EXPECT(chorus_ireduce(comm, sum_in, sum_out, 4, CHORUS_INT32, CHORUS_SUM, p, &bad),
           CHORUS_INVALID_ARGUMENT);
    CHECK(bad == NULL && strstr(chorus_last_error(), "root") != NULL, "message: %s",
          chorus_last_error());
    EXPECT(chorus_iscatter(comm, sum_in, sum_out, 1, CHORUS_INT32, -1, &bad),
           CHORUS_INVALID_ARGUMENT);
    /* So is a bitwise operator on floats. */
    float fin[4] = {1, 2, 3, 4}, fout[4];
    EXPECT(chorus_ireduce(comm, fin, fout, 4, CHORUS_FLOAT32, CHORUS_BAND, 0, &bad),
           CHORUS_INVALID_ARGUMENT);
    CHECK(bad == NULL && strstr(chorus_last_error(), "bitwise") != NULL, "message: %s",
          chorus_last_error());
    {
        /* A request that fails when it runs: a send to this rank itself met by a receive of
         * another length and dtype (both halves fail; the communicator stays usable). */
        chorus_request *two[2], *s = NULL;
        int32_t four = 7;
        int64_t eight = 0;
        OK(chorus_ibarrier(comm, &two[0]));
        OK(chorus_isend(comm, &four, 1, CHORUS_INT32, me, &s));
        OK(chorus_irecv(comm, &eight, 1, CHORUS_INT64, me, &two[1]));
        EXPECT(chorus_waitall(2, two), CHORUS_MISMATCH);
        CHECK(strstr(chorus_last_error(), "request 1 of 2") != NULL, "waitall message: %s",
              chorus_last_error());
        CHECK(two[0] == NULL && two[1] == NULL, "waitall left a request set");
        EXPECT(chorus_wait(&s), CHORUS_MISMATCH);
        CHECK(s == NULL, "a failed request was not cleared");
    }
    EXPECT(chorus_ibarrier(NULL, &bad), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_wait(NULL), CHORUS_INVALID_ARGUMENT);
    bad = NULL;
    OK(chorus_wait(&bad));
    int done = 0;
    OK(chorus_test(&bad, &done));
    CHECK(done == 1, "chorus_test of a NULL request: done = %d", done);
    EXPECT(chorus_test(&bad, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_waitall(2, NULL), CHORUS_INVALID_ARGUMENT);
    OK(chorus_waitall(0, NULL));
    /* waitany, testany and testall: three requests and a NULL; waitany returns each index
     * once, then -1; testall and testany on a finished set complete it. */
    {
        chorus_request *rs[4] = {NULL, NULL, NULL, NULL};
        int32_t w[64];
        for (int i = 0; i < 64; i++) w[i] = me + i;
        OK(chorus_iallreduce(comm, w, w, 64, CHORUS_INT32, CHORUS_SUM, NULL, &rs[0]));
        OK(chorus_ibarrier(comm, &rs[2]));
        OK(chorus_ibroadcast(comm, w, 64, CHORUS_INT32, 0, &rs[3]));
        int seen[4] = {0, 0, 0, 0}, idx = -2;
        for (int n = 0; n < 3; n++) {
            OK(chorus_waitany(4, rs, &idx));
            CHECK(idx == 0 || idx == 2 || idx == 3, "waitany index %d", idx);
            CHECK(!seen[idx] && rs[idx] == NULL, "waitany gave %d twice or left it set", idx);
            seen[idx] = 1;
        }
        OK(chorus_waitany(4, rs, &idx));
        CHECK(idx == -1, "waitany of NULL requests: index %d", idx);
        for (int i = 0; i < 64; i++)
            CHECK(w[i] == p * (p - 1) / 2 + p * i, "waitany's allreduce [%d] = %d", i, w[i]);
        int fin = -1;
        OK(chorus_testany(4, rs, &idx, &fin));
        CHECK(fin == 1 && idx == -1, "testany of NULL requests: done %d index %d", fin, idx);
        OK(chorus_testall(4, rs, &fin));
        CHECK(fin == 1, "testall of NULL requests: done %d", fin);
        /* testall until all are done, then they are completed */
        OK(chorus_ibarrier(comm, &rs[1]));
        OK(chorus_ibarrier(comm, &rs[3]));
        fin = 0;
        /* Bounded in time, not in calls: the peers may be descheduled for a while. */
        double until = now_s() + 20.0;
        while (!fin && now_s() < until) {
            OK(chorus_testall(4, rs, &fin));
            if (!fin) sleep_ms(1);
        }
        CHECK(fin == 1 && rs[1] == NULL && rs[3] == NULL, "testall: done %d", fin);
        /* testany until one is done */
        OK(chorus_ibarrier(comm, &rs[2]));
        fin = 0;
        until = now_s() + 20.0;
        while (!fin && now_s() < until) {
            OK(chorus_testany(4, rs, &idx, &fin));
            if (!fin) sleep_ms(1);
        }
        CHECK(fin == 1 && idx == 2 && rs[2] == NULL, "testany: done %d index %d", fin, idx);
        /* a stale pointer in the array is refused before anything completes */
        chorus_request *stale = NULL;
        OK(chorus_ibarrier(comm, &rs[0]));
        stale = rs[0];
        OK(chorus_wait(&rs[0]));
        rs[1] = stale;
        EXPECT(chorus_waitany(4, rs, &idx), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_testall(4, rs, &fin), CHORUS_INVALID_ARGUMENT);
        rs[1] = NULL;
        EXPECT(chorus_waitany(4, rs, NULL), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_waitany(2, NULL, &idx), CHORUS_INVALID_ARGUMENT);
        OK(chorus_barrier(comm));
    }
    /* A request completed through one copy of its pointer is refused through another (no
     * double free), also when it appears twice in one waitall; a misaligned slot is refused. */
    {
        chorus_request *r = NULL, *copy, *twice[2];
        OK(chorus_ibarrier(comm, &r));
        copy = r;
        OK(chorus_wait(&r));
        EXPECT(chorus_wait(&copy), CHORUS_INVALID_ARGUMENT);
        CHECK(strstr(chorus_last_error(), "not a live request") != NULL, "message: %s", chorus_last_error());
        OK(chorus_ibarrier(comm, &r));
        copy = r;
        OK(chorus_wait(&r));
        EXPECT(chorus_test(&copy, &done), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_request_free(&copy), CHORUS_INVALID_ARGUMENT);
        OK(chorus_ibarrier(comm, &twice[0]));
        twice[1] = twice[0];
        EXPECT(chorus_waitall(2, twice), CHORUS_INVALID_ARGUMENT);
        CHECK(strstr(chorus_last_error(), "request 1 of 2") != NULL, "waitall message: %s", chorus_last_error());
        CHECK(twice[0] == NULL && twice[1] == NULL, "waitall left a request set");
        _Alignas(chorus_request *) char raw[2 * sizeof(chorus_request *)] = {0};
        EXPECT(chorus_wait((chorus_request **)(raw + 1)), CHORUS_INVALID_ARGUMENT);
        CHECK(strstr(chorus_last_error(), "aligned") != NULL, "message: %s", chorus_last_error());
        /* A misaligned out-parameter is refused, and the request is left as it was. */
        _Alignas(int) char ints[2 * sizeof(int)] = {0};
        int *bad_index = (int *)(ints + 1);
        OK(chorus_ibarrier(comm, &r));
        EXPECT(chorus_waitany(1, &r, bad_index), CHORUS_INVALID_ARGUMENT);
        CHECK(r != NULL, "waitany completed the request and then failed");
        EXPECT(chorus_testany(1, &r, bad_index, &done), CHORUS_INVALID_ARGUMENT);
        CHECK(r != NULL, "testany completed the request and then failed");
        OK(chorus_wait(&r));
        EXPECT(chorus_compressor_create((chorus_compressor **)(raw + 1), "int8"),
               CHORUS_INVALID_ARGUMENT);
        OK(chorus_barrier(comm));
    }
    /* A freed request's call still runs, before the next blocking call returns. */
    {
        chorus_request *gone = NULL;
        for (int i = 0; i < 1000; i++) sum_out[i] = me + i;
        OK(chorus_iallreduce(comm, sum_out, sum_out, 1000, CHORUS_INT32, CHORUS_SUM, NULL, &gone));
        OK(chorus_request_free(&gone));
        CHECK(gone == NULL, "chorus_request_free left the request set");
        OK(chorus_request_free(&gone));
        EXPECT(chorus_request_free(NULL), CHORUS_INVALID_ARGUMENT);
        OK(chorus_barrier(comm));
        for (int i = 0; i < 1000; i++)
            CHECK(sum_out[i] == p * (p - 1) / 2 + p * i, "freed request's allreduce [%d] = %d", i, sum_out[i]);
        /* A call that has already ended gives its status when its request is freed (a send
         * to this rank itself met by a receive of another length and dtype: both fail, the
         * communicator stays usable). */
        int32_t four = 7;
        int64_t eight = 0;
        chorus_request *half = NULL;
        OK(chorus_isend(comm, &four, 1, CHORUS_INT32, me, &gone));
        OK(chorus_irecv(comm, &eight, 1, CHORUS_INT64, me, &half));
        /* The receive half finishes after the send half: once it has, both have. */
        EXPECT(chorus_wait(&half), CHORUS_MISMATCH);
        EXPECT(chorus_request_free(&gone), CHORUS_MISMATCH);
        CHECK(gone == NULL, "chorus_request_free left a finished request set");
        OK(chorus_barrier(comm));
    }
    /* A communicator destroyed with calls in flight waits for them; their requests still
     * report. */
    chorus_request *late[2];
    for (int i = 0; i < 1000; i++) sum_in[i] = me;
    OK(chorus_iallreduce(comm, sum_in, sum_in, 1000, CHORUS_INT32, CHORUS_SUM, NULL, &late[0]));
    OK(chorus_ibarrier(comm, &late[1]));
    OK(chorus_comm_destroy(comm));
    OK(chorus_waitall(2, late));
    for (int i = 0; i < 1000; i++) CHECK(sum_in[i] == p * (p - 1) / 2, "late [%d] = %d", i, sum_in[i]);
    free(sum_in); free(sum_out); free(bc); free(red); free(ag); free(rs_in); free(rs_out);
    free(a2a); free(ga); free(sc_in); free(sc_out); free(agv); free(a2av_in); free(a2av_out);
    free(rc); free(sc); free(rc2);
}

static void transfers(chorus_comm *comm) {
    const int me = g_rank, p = g_size;
    const int right = (me + 1) % p, left = (me + p - 1) % p;
    const size_t n = 1 << 20; /* 4 MiB of int32: more than the kernel buffers */
    int32_t *out = malloc(n * sizeof *out), *in = malloc(n * sizeof *in);
    int32_t *out2 = malloc(n * sizeof *out2), *in2 = malloc(n * sizeof *in2);
    CHECK(out && in && out2 && in2, "malloc");
    for (size_t i = 0; i < n; i++) {
        out[i] = me * 1000003 + (int32_t)i;
        out2[i] = -out[i];
    }
    /* Both sends around the ring before any receive, the receives waited in reverse. */
    chorus_request *rq[4] = {NULL, NULL, NULL, NULL};
    OK(chorus_isend(comm, out, n, CHORUS_INT32, right, &rq[0]));
    OK(chorus_isend(comm, out2, n, CHORUS_INT32, right, &rq[1]));
    OK(chorus_irecv(comm, in, n, CHORUS_INT32, left, &rq[2]));
    OK(chorus_irecv(comm, in2, n, CHORUS_INT32, left, &rq[3]));
    OK(chorus_wait(&rq[3]));
    OK(chorus_wait(&rq[2]));
    OK(chorus_waitall(2, rq));
    for (size_t i = 0; i < n; i++) {
        CHECK(in[i] == left * 1000003 + (int32_t)i, "first message [%zu] = %d", i, in[i]);
        CHECK(in2[i] == -(left * 1000003 + (int32_t)i), "second message [%zu] = %d", i, in2[i]);
    }
    /* To itself, matched in order; a blocking recv among live transfers keeps its place. */
    int64_t a = 11, b = 22, x = 0, y = 0;
    OK(chorus_isend(comm, &a, 1, CHORUS_INT64, me, &rq[0]));
    OK(chorus_isend(comm, &b, 1, CHORUS_INT64, me, &rq[1]));
    OK(chorus_irecv(comm, &x, 1, CHORUS_INT64, me, &rq[2]));
    OK(chorus_irecv(comm, &y, 1, CHORUS_INT64, me, &rq[3]));
    OK(chorus_waitall(4, rq));
    CHECK(x == 11 && y == 22, "to itself: %lld %lld", (long long)x, (long long)y);
    if (p > 1) {
        int32_t first = 0, second = 0, v1 = me + 100, v2 = me + 200;
        OK(chorus_irecv(comm, &first, 1, CHORUS_INT32, left, &rq[0]));
        OK(chorus_isend(comm, &v1, 1, CHORUS_INT32, right, &rq[1]));
        OK(chorus_send(comm, &v2, 1, CHORUS_INT32, right));
        OK(chorus_recv(comm, &second, 1, CHORUS_INT32, left));
        OK(chorus_waitall(2, rq));
        CHECK(first == left + 100 && second == left + 200, "in order: %d %d", first, second);
    }
    /* A batch started with one call: both sends before the receives (4 MiB each, more than
     * the kernel buffers), each request completed by itself, the receives first. */
    for (size_t i = 0; i < n; i++) in[i] = in2[i] = 0;
    chorus_p2p_op ops[4] = {
        {out, n, CHORUS_INT32, right, CHORUS_P2P_SEND},
        {out2, n, CHORUS_INT32, left, CHORUS_P2P_SEND},
        {in, n, CHORUS_INT32, left, CHORUS_P2P_RECV},
        {in2, n, CHORUS_INT32, right, CHORUS_P2P_RECV},
    };
    chorus_request *br[4] = {NULL, NULL, NULL, NULL};
    OK(chorus_batch_isend_irecv(comm, ops, 4, br));
    for (int i = 0; i < 4; i++) CHECK(br[i] != NULL, "batch request %d not set", i);
    OK(chorus_wait(&br[3]));
    OK(chorus_wait(&br[2]));
    OK(chorus_waitall(4, br));
    for (size_t i = 0; i < n; i++) {
        CHECK(in[i] == left * 1000003 + (int32_t)i, "batch from the left [%zu] = %d", i, in[i]);
        CHECK(in2[i] == -(right * 1000003 + (int32_t)i), "batch from the right [%zu] = %d", i,
              in2[i]);
    }
    /* A bad op refuses the whole batch: nothing starts, every request stays NULL. */
    br[0] = br[1] = (chorus_request *)&ops[0]; /* garbage the call must overwrite */
    chorus_p2p_op bad[2] = {
        {&a, 1, CHORUS_INT64, me, CHORUS_P2P_SEND},
        {&x, 1, CHORUS_INT64, p, CHORUS_P2P_RECV},
    };
    EXPECT(chorus_batch_isend_irecv(comm, bad, 2, br), CHORUS_INVALID_ARGUMENT);
    CHECK(strstr(chorus_last_error(), "ops[1].peer") != NULL, "message: %s", chorus_last_error());
    CHECK(br[0] == NULL && br[1] == NULL, "a refused batch left requests");
    bad[1].peer = me;
    bad[1].buf = &a; /* a receive overlapping the send */
    EXPECT(chorus_batch_isend_irecv(comm, bad, 2, br), CHORUS_INVALID_ARGUMENT);
    bad[1].kind = (chorus_p2p_kind)7;
    EXPECT(chorus_batch_isend_irecv(comm, bad, 2, br), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_batch_isend_irecv(comm, bad, 2, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_batch_isend_irecv(comm, NULL, 2, br), CHORUS_INVALID_ARGUMENT);
    OK(chorus_batch_isend_irecv(comm, NULL, 0, NULL));
    /* The refused batches sent nothing, and a batch's transfers start in its order: these two
     * to itself are matched first, in turn, by receives issued one by one. */
    bad[1] = (chorus_p2p_op){&b, 1, CHORUS_INT64, me, CHORUS_P2P_SEND};
    x = y = 0;
    OK(chorus_batch_isend_irecv(comm, bad, 2, br));
    OK(chorus_irecv(comm, &x, 1, CHORUS_INT64, me, &br[2]));
    OK(chorus_irecv(comm, &y, 1, CHORUS_INT64, me, &br[3]));
    OK(chorus_waitall(4, br));
    CHECK(x == 11 && y == 22, "batch to itself: %lld %lld", (long long)x, (long long)y);
    /* Collectives are refused while a transfer is live (the communicator stays usable); a dup
     * made before runs them meanwhile. */
    chorus_comm *dup = NULL;
    OK(chorus_comm_dup(comm, &dup));
    int64_t pending = -1, one = 1, sum = 0;
    OK(chorus_irecv(comm, &pending, 1, CHORUS_INT64, me, &rq[0]));
    EXPECT(chorus_allreduce(comm, &one, &sum, 1, CHORUS_INT64, CHORUS_SUM), CHORUS_INVALID_USAGE);
    CHECK(strstr(chorus_last_error(), "isend/irecv") != NULL, "message: %s", chorus_last_error());
    EXPECT(chorus_ibarrier(comm, &rq[1]), CHORUS_INVALID_USAGE);
    CHECK(rq[1] == NULL, "a refused call left a request");
    OK(chorus_allreduce(dup, &one, &sum, 1, CHORUS_INT64, CHORUS_SUM));
    CHECK(sum == p, "sum on the dup: %lld", (long long)sum);
    OK(chorus_isend(comm, &a, 1, CHORUS_INT64, me, &rq[1]));
    OK(chorus_waitall(2, rq));
    CHECK(pending == 11, "late receive from itself: %lld", (long long)pending);
    OK(chorus_allreduce(comm, &one, &sum, 1, CHORUS_INT64, CHORUS_SUM));
    CHECK(sum == p, "sum after the transfers: %lld", (long long)sum);
    /* chorus_comm_transfers counts the transfers not yet finished, given-up ones included. */
    size_t live = 99;
    OK(chorus_comm_transfers(comm, &live));
    CHECK(live == 0, "transfers after waitall: %zu", live);
    OK(chorus_isend(comm, &a, 1, CHORUS_INT64, me, &rq[0]));
    OK(chorus_request_free(&rq[0]));
    OK(chorus_comm_transfers(comm, &live));
    CHECK(live == 1, "a given-up send to itself, unmatched: %zu", live);
    OK(chorus_irecv(comm, &x, 1, CHORUS_INT64, me, &rq[1]));
    OK(chorus_wait(&rq[1]));
    for (int i = 0; i < 5000 && live != 0; i++) {
        OK(chorus_comm_transfers(comm, &live));
        if (live != 0) sleep_ms(1);
    }
    CHECK(live == 0, "transfers once the send to itself is matched: %zu", live);
    EXPECT(chorus_comm_transfers(comm, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_comm_transfers(NULL, &live), CHORUS_INVALID_ARGUMENT);
    /* Buffers of live transfers: a receive may overlap no other live transfer's buffer
       (sends may share theirs); the hold ends when the request is waited for. */
    int32_t ov[8] = {1, 2, 3, 4, 5, 6, 7, 8}, got[8] = {0};
    OK(chorus_isend(comm, ov, 4, CHORUS_INT32, me, &rq[0]));
    EXPECT(chorus_irecv(comm, ov + 3, 2, CHORUS_INT32, me, &rq[1]), CHORUS_INVALID_ARGUMENT);
    CHECK(rq[1] == NULL, "a refused receive left a request");
    CHECK(strstr(chorus_last_error(), "overlaps") != NULL, "message: %s", chorus_last_error());
    EXPECT(chorus_recv(comm, ov, 1, CHORUS_INT32, right), CHORUS_INVALID_ARGUMENT);
    if (p > 1) /* (to this rank itself a blocking receive is refused anyway) */
        CHECK(strstr(chorus_last_error(), "overlaps") != NULL, "message: %s", chorus_last_error());
    OK(chorus_isend(comm, ov + 2, 4, CHORUS_INT32, me, &rq[1]));
    OK(chorus_irecv(comm, got, 4, CHORUS_INT32, me, &rq[2]));
    {
        chorus_p2p_op bad[2] = {
            {got + 4, 4, CHORUS_INT32, me, CHORUS_P2P_RECV},
            {got + 2, 1, CHORUS_INT32, me, CHORUS_P2P_RECV}, /* into the live receive's */
        };
        chorus_request *br[2] = {NULL, NULL};
        EXPECT(chorus_batch_isend_irecv(comm, bad, 2, br), CHORUS_INVALID_ARGUMENT);
        CHECK(br[0] == NULL && br[1] == NULL, "a refused batch left requests");
        CHECK(strstr(chorus_last_error(), "ops[1]") != NULL, "message: %s", chorus_last_error());
    }
    OK(chorus_irecv(comm, got + 4, 4, CHORUS_INT32, me, &rq[3]));
    OK(chorus_waitall(4, rq));
    for (int i = 0; i < 8; i++)
        CHECK(got[i] == (i < 4 ? i + 1 : i - 1), "to itself from shared sends [%d] = %d", i, got[i]);
    OK(chorus_isend(comm, got + 6, 2, CHORUS_INT32, me, &rq[0]));
    OK(chorus_irecv(comm, ov, 2, CHORUS_INT32, me, &rq[1])); /* free again once waited for */
    OK(chorus_waitall(2, rq));
    CHECK(ov[0] == 5 && ov[1] == 6, "into a buffer no longer held: %d %d", ov[0], ov[1]);
    /* Bad arguments, refused at once. */
    EXPECT(chorus_isend(comm, &a, 1, CHORUS_INT64, p, &rq[0]), CHORUS_INVALID_ARGUMENT);
    CHECK(rq[0] == NULL, "a refused transfer left a request");
    EXPECT(chorus_irecv(comm, NULL, 1, CHORUS_INT64, me, &rq[0]), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_irecv(comm, &x, 1, CHORUS_INT64, me, NULL), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_isend(NULL, &a, 1, CHORUS_INT64, me, &rq[0]), CHORUS_INVALID_ARGUMENT);
    EXPECT(chorus_isend(comm, &a, 1, (chorus_dtype)99, me, &rq[0]), CHORUS_INVALID_ARGUMENT);
    /* A freed request's transfer goes on; destroying the communicator waits for it. */
    for (size_t i = 0; i < n; i++) in[i] = 0;
    OK(chorus_isend(comm, out, n, CHORUS_INT32, right, &rq[0]));
    OK(chorus_irecv(comm, in, n, CHORUS_INT32, left, &rq[1]));
    OK(chorus_request_free(&rq[0]));
    OK(chorus_request_free(&rq[1]));
    OK(chorus_comm_destroy(comm));
    for (size_t i = 0; i < n; i++)
        CHECK(in[i] == left * 1000003 + (int32_t)i, "freed transfer [%zu] = %d", i, in[i]);
    OK(chorus_comm_destroy(dup));
    free(out); free(in); free(out2); free(in2);
}

/* Requests across a fork (as a DataLoader worker forks a rank): the child cannot complete the
 * parent's requests (refused as such), and its own requests are checked as the parent's are: a
 * request waited twice through a copy is refused, not freed twice. */
static void forked(chorus_comm *comm) {
    int32_t in[4] = {1, 1, 1, 1}, out[4];
    chorus_request *parents = NULL;
    OK(chorus_iallreduce(comm, in, out, 4, CHORUS_INT32, CHORUS_SUM, NULL, &parents));
    chorus_compressor *pcomp = NULL;
    OK(chorus_compressor_create(&pcomp, "int8"));
    fflush(stdout);
    pid_t pid = fork();
    CHECK(pid >= 0, "fork");
    if (pid == 0) {
        chorus_request *copy = parents;
        EXPECT(chorus_wait(&copy), CHORUS_INVALID_USAGE);
        CHECK(strstr(chorus_last_error(), "forked") != NULL, "message: %s", chorus_last_error());
        /* A communicator of the child's own (a group of one) and its requests. */
        chorus_comm *own = NULL;
        OK(chorus_comm_init(&own, 0, 1, "127.0.0.1:0", ""));
        int32_t a[2] = {3, 4}, b[2] = {0, 0};
        chorus_request *r = NULL;
        OK(chorus_iallreduce(own, a, b, 2, CHORUS_INT32, CHORUS_SUM, NULL, &r));
        chorus_request *again = r;
        OK(chorus_wait(&r));
        CHECK(b[0] == 3 && b[1] == 4, "child's allreduce %d %d", b[0], b[1]);
        EXPECT(chorus_wait(&again), CHORUS_INVALID_ARGUMENT);
        CHECK(strstr(chorus_last_error(), "not a live request") != NULL, "message: %s",
              chorus_last_error());
        OK(chorus_comm_destroy(own));
        /* The parent's communicator and compressor: destroyed here without touching what
         * the parent uses, and refused afterwards. */
        int n = 0;
        OK(chorus_comm_destroy(comm));
        EXPECT(chorus_comm_size(comm, &n), CHORUS_INVALID_ARGUMENT);
        EXPECT(chorus_comm_destroy(comm), CHORUS_INVALID_ARGUMENT);
        OK(chorus_compressor_destroy(pcomp));
        EXPECT(chorus_compressor_destroy(pcomp), CHORUS_INVALID_ARGUMENT);
        fflush(stdout);
        _exit(0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid, "waitpid");
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child status %d", status);
    OK(chorus_wait(&parents));
    for (int i = 0; i < 4; i++) CHECK(out[i] == g_size, "out[%d] = %d", i, out[i]);
    /* The parent's handles are unaffected by the child's destroys. */
    int n = 0;
    OK(chorus_comm_size(comm, &n));
    CHECK(n == g_size, "size %d", n);
    OK(chorus_compressor_destroy(pcomp));
}

/* The communicator `atexit_mode` leaves to the exit handler. */
static chorus_comm *g_exit_comm = NULL;

/* An exit handler that uses the library (as a C++ static's destructor would): glibc's `exit`
   has destroyed the main thread's thread locals by then, and no call may abort the process. */
static void at_exit_destroy(void) {
    int r = -1;
    int st = chorus_comm_rank(g_exit_comm, &r);
    const char *msg = chorus_last_error();
    int st2 = chorus_comm_destroy(g_exit_comm);
    if (st != CHORUS_OK || r != g_rank || msg == NULL || st2 != CHORUS_OK) {
        fprintf(stderr, "rank %d: calls from an exit handler: %d %d %d\n", g_rank, st, r, st2);
        fflush(stderr);
        _Exit(3);
    }
    printf("exit handler done\n");
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s sweep|collectives|badargs|compression|mismatch KIND|peer_exit|peer_abort|busy|split|uniqueid|nonblocking|transfers|atexit|fork\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    chorus_comm *comm = NULL;
    OK(chorus_comm_init_env(&comm));
    CHECK(comm != NULL, "init returned NULL");
    OK(chorus_comm_rank(comm, &g_rank));
    OK(chorus_comm_size(comm, &g_size));
    CHECK(g_size >= 1 && g_rank >= 0 && g_rank < g_size, "rank %d size %d", g_rank, g_size);
    CHECK(g_size <= 4, "these inputs are exact for at most 4 ranks");

    if (strcmp(mode, "sweep") == 0) sweep(comm);
    else if (strcmp(mode, "collectives") == 0) collectives(comm);
    else if (strcmp(mode, "badargs") == 0) badargs(comm);
    else if (strcmp(mode, "compression") == 0) compression(comm);
    else if (strcmp(mode, "mismatch") == 0 && argc > 2) mismatch(comm, argv[2]);
    else if (strcmp(mode, "peer_exit") == 0) peer_gone(comm, 0);
    else if (strcmp(mode, "peer_abort") == 0) peer_gone(comm, 1);
    else if (strcmp(mode, "busy") == 0) busy(comm);
    else if (strcmp(mode, "uniqueid") == 0) uniqueid(comm);
    else if (strcmp(mode, "fork") == 0) forked(comm);
    else if (strcmp(mode, "transfers") == 0) {
        transfers(comm); /* destroys the communicator itself */
        comm = NULL;
    }
    else if (strcmp(mode, "nonblocking") == 0) {
        nonblocking(comm); /* destroys the communicator itself */
        comm = NULL;
    }
    else if (strcmp(mode, "atexit") == 0) {
        int64_t v = 1;
        OK(chorus_allreduce(comm, &v, &v, 1, CHORUS_INT64, CHORUS_SUM));
        CHECK(v == g_size, "sum of ones: %lld", (long long)v);
        OK(chorus_barrier(comm));
        g_exit_comm = comm;
        comm = NULL;
        CHECK(atexit(at_exit_destroy) == 0, "atexit");
    }
    else if (strcmp(mode, "split") == 0) {
        /* The half needs nothing of the parent: free the parent first, then use the half. */
        chorus_comm *half = split(comm);
        OK(chorus_comm_destroy(comm));
        comm = NULL;
        int64_t v = 1;
        OK(chorus_allreduce(half, &v, &v, 1, CHORUS_INT64, CHORUS_SUM));
        CHECK(v == (g_size + 1 - g_rank % 2) / 2, "sum of ones over the half: %lld", (long long)v);
        OK(chorus_comm_destroy(half));
    }
    else CHECK(0, "unknown mode %s", mode);

    OK(chorus_comm_destroy(comm));
    printf("ok %s\n", mode);
    return 0;
}
