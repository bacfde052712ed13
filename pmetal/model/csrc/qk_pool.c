/* The worker pool behind qk_parallel: persistent pthreads, created lazily,
 * grown to the largest thread count asked for, never shrunk.
 *
 * A job is a count of items handed out by one atomic counter, so a thread
 * that the OS deschedules holds up only the item it is computing; the caller
 * takes items too.  The counter carries the job's generation in its high 32
 * bits and is advanced by compare-and-swap, so a worker that wakes late for
 * an old job can never take (or skip) an item of the next one.
 *
 * Waiting: an idle worker spins for QK_SPIN_NS on the generation, then
 * sleeps on a condition variable, so an idle pool burns no CPU.  Every
 * sleep is a timed wait that re-checks its condition.  One job runs at a
 * time; a second concurrent caller (another Python thread with the GIL
 * released) runs its items itself rather than queueing.
 *
 * Fork: the child of a fork has none of the workers.  A pthread_atfork child
 * handler forgets the pool (its memory is leaked: its mutexes may have been
 * held at the fork), and the next job in the child builds a new one.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "qk.h"

#ifndef QK_SPIN_NS
#define QK_SPIN_NS 50000   /* 50 us: bridges consecutive matmuls of one decode step */
#endif
#define QK_MAX_THREADS 256

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;          /* a new generation was published */
    pthread_cond_t finished;      /* the last item of a job completed */
    pthread_mutex_t submit;       /* held by the one caller running a job */
    _Atomic uint32_t gen;
    _Atomic uint64_t next;        /* (gen << 32) | next item */
    _Atomic int64_t done;
    qk_task_fn fn;                /* the job of generation gen (under mu) */
    void *ctx;
    int64_t n_items;
    int helpers, tickets;
    int nworkers;
    pid_t pid;
} qk_pool;

static qk_pool *g_pool;
static pthread_mutex_t g_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;

static void qk_atfork_child(void) {
    g_pool = NULL;
    pthread_mutex_t fresh = PTHREAD_MUTEX_INITIALIZER;
    g_pool_mu = fresh;
}

static void qk_register_atfork(void) { pthread_atfork(NULL, NULL, qk_atfork_child); }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void deadline_in(struct timespec *ts, int64_t ns) {
#if defined(__linux__)
    clock_gettime(CLOCK_MONOTONIC, ts);
#else
    clock_gettime(CLOCK_REALTIME, ts);
#endif
    int64_t t = (int64_t)ts->tv_nsec + ns;
    ts->tv_sec += (time_t)(t / 1000000000);
    ts->tv_nsec = (long)(t % 1000000000);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Take and run items of generation g until there are none left. */
static void run_items(qk_pool *p, uint32_t g, qk_task_fn fn, void *ctx, int64_t n) {
    uint64_t v = atomic_load_explicit(&p->next, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(v >> 32) != g || (int64_t)(uint32_t)v >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&p->next, &v, v + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(ctx, (int64_t)(uint32_t)v);
        if (atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel) + 1 == n) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_broadcast(&p->finished);
            pthread_mutex_unlock(&p->mu);
        }
        v = atomic_load_explicit(&p->next, memory_order_acquire);
    }
}

static void *worker_main(void *arg) {
    qk_pool *p = arg;
    pthread_mutex_lock(&p->mu);
    uint32_t seen = atomic_load(&p->gen);
    pthread_mutex_unlock(&p->mu);
    for (;;) {
        const int64_t spin_until = now_ns() + QK_SPIN_NS;
        for (int i = 0; atomic_load_explicit(&p->gen, memory_order_acquire) == seen; i++) {
            if ((i & 63) == 63 && now_ns() > spin_until) break;
            cpu_relax();
        }
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->gen) == seen) {
            struct timespec ts;
            deadline_in(&ts, 1000000000);   /* re-check once a second */
            pthread_cond_timedwait(&p->wake, &p->mu, &ts);
        }
        seen = atomic_load(&p->gen);
        const int mine = p->tickets < p->helpers;
        p->tickets += mine;
        qk_task_fn fn = p->fn;
        void *ctx = p->ctx;
        const int64_t n = p->n_items;
        pthread_mutex_unlock(&p->mu);
        if (mine) run_items(p, seen, fn, ctx, n);
    }
    return NULL;
}

static qk_pool *pool_get(int workers) {
    pthread_once(&g_atfork_once, qk_register_atfork);
    pthread_mutex_lock(&g_pool_mu);
    qk_pool *p = g_pool;
    if (p && p->pid != getpid()) p = NULL;   /* forked without our handler: start over */
    if (!p) {
        p = calloc(1, sizeof *p);
        if (!p) { pthread_mutex_unlock(&g_pool_mu); return NULL; }
        pthread_mutex_init(&p->mu, NULL);
        pthread_mutex_init(&p->submit, NULL);
        pthread_condattr_t ca;
        pthread_condattr_init(&ca);
#if defined(__linux__)
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);   /* deadlines immune to clock steps */
#endif
        pthread_cond_init(&p->wake, &ca);
        pthread_cond_init(&p->finished, &ca);
        pthread_condattr_destroy(&ca);
        p->pid = getpid();
        g_pool = p;
    }
    while (p->nworkers < workers && p->nworkers < QK_MAX_THREADS) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &attr, worker_main, p);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;   /* fewer helpers: the caller's share grows */
        p->nworkers++;
    }
    pthread_mutex_unlock(&g_pool_mu);
    return p;
}

void qk_parallel(int threads, int64_t n, qk_task_fn fn, void *ctx) {
    qk_pool *p = NULL;
    if (threads > 1 && n > 1) {
        p = pool_get(threads - 1);
        if (p && pthread_mutex_trylock(&p->submit) != 0) p = NULL;
    }
    if (!p) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n_items = n;
    p->helpers = threads - 1 < p->nworkers ? threads - 1 : p->nworkers;
    p->tickets = 0;
    atomic_store(&p->done, 0);
    const uint32_t g = atomic_load(&p->gen) + 1;
    atomic_store_explicit(&p->next, (uint64_t)g << 32, memory_order_release);
    atomic_store_explicit(&p->gen, g, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);

    run_items(p, g, fn, ctx, n);

    /* Items other threads hold: spin briefly, then sleep with a deadline. */
    const int64_t spin_until = now_ns() + QK_SPIN_NS;
    for (int i = 0; atomic_load_explicit(&p->done, memory_order_acquire) != n; i++) {
        if ((i & 63) == 63 && now_ns() > spin_until) break;
        cpu_relax();
    }
    if (atomic_load_explicit(&p->done, memory_order_acquire) != n) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load(&p->done) != n) {
            struct timespec ts;
            deadline_in(&ts, 10000000);   /* 10 ms, then re-check */
            pthread_cond_timedwait(&p->finished, &p->mu, &ts);
        }
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&p->submit);
}
