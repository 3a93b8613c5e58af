/* The CPU pool's scope (cpu_pool.h), as the core enters it around each
 * graph run: two functions handed over in a capsule by the C++ extension,
 * which the core cannot link against (it is built without torch's
 * headers).  Plain C: both extensions include it. */
#ifndef FASTLAZY_CPU_POOL_SCOPE_H
#define FASTLAZY_CPU_POOL_SCOPE_H

#define FL_CPU_POOL_CAPSULE "fastlazy.fl_cpu_pool_scope"

typedef struct {
    void (*enter)(void);    /* this thread's large CPU allocations come from the pool ... */
    void (*exit)(void);     /* ... until the matching exit (scopes nest) */
} fl_cpu_pool_scope;

#endif
