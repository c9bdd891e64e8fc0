/* A small reuse pool in front of CPython's arena allocator (PyObject_SetArenaAllocator).
 *
 * Why: CPython 3.11 and 3.12 keep each thread's frames in 16 KiB "data stack chunks" that come
 * from the arena allocator (mmap) and go back to it (munmap) as soon as the first frame in a
 * chunk returns (python/cpython#142183; 3.13 and 3.14 now cache one chunk per thread). A loop
 * that keeps calling across a chunk boundary, e.g. an FX graph's forward calling its ops, pays an
 * mmap, a page fault and an munmap per call; on a VM each munmap is a TLB shoot-down to the other
 * cores (an IPI), which costs tens of microseconds while torch's OpenMP threads run there. Measured
 * on SmolLM2's eager INT4 decode graph: 40% of the main thread's time, half the speed.
 *
 * What: freed blocks of up to CACHE_MAX_BYTES go into CACHE_SLOTS slots of their class (stack
 * chunks, arenas) instead of back to the previous allocator (when all are taken, the block of that
 * class freed longest ago goes back to make room); an allocation of exactly a cached size takes one. Everything else goes to
 * the previous allocator unchanged. CPython calls these with the GIL held (3.11/3.12 have no
 * free-threaded build), so the slots need no lock. No memory is returned zeroed, as with the
 * allocator's malloc fallback, so CPython does not rely on it.
 *
 * Built by backends/native/build.py; installed by runtime/arena_reuse.py. */
#include <stddef.h>
#include <stdint.h>

/* The layout of PyObjectArenaAllocator (Include/cpython/objimpl.h). */
typedef struct {
    void *ctx;
    void *(*alloc)(void *ctx, size_t size);
    void (*free)(void *ctx, void *ptr, size_t size);
} arena_allocator;

#define CACHE_SLOTS 4 /* per class */
#define CACHE_MAX_BYTES ((size_t)1 << 20) /* pymalloc's arenas are 1 MiB; stack chunks 16 KiB+ */

/* Two classes of slots, so that neither kind of block can crowd the other out: frame-stack
 * chunks (< 1 MiB) and pymalloc arenas (1 MiB). */
static arena_allocator previous;
static void *slot_ptr[2][CACHE_SLOTS];
static size_t slot_size[2][CACHE_SLOTS];
static int next_victim[2];
static int64_t hits, misses, released;

static int size_class(size_t size) { return size >= CACHE_MAX_BYTES ? 1 : 0; }

static void *cache_alloc(void *ctx, size_t size) {
    (void)ctx;
    int c = size_class(size);
    for (int i = 0; i < CACHE_SLOTS; i++) {
        if (slot_ptr[c][i] != NULL && slot_size[c][i] == size) {
            void *p = slot_ptr[c][i];
            slot_ptr[c][i] = NULL;
            hits++;
            return p;
        }
    }
    misses++;
    return previous.alloc(previous.ctx, size);
}

static void cache_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    if (ptr == NULL || size > CACHE_MAX_BYTES) {
        released++;
        previous.free(previous.ctx, ptr, size);
        return;
    }
    int c = size_class(size);
    int i = 0;
    while (i < CACHE_SLOTS && slot_ptr[c][i] != NULL) i++;
    if (i == CACHE_SLOTS) {
        /* the class's slots are all taken: the block freed longest ago goes back, so blocks of
         * a size that is never asked for again cannot keep the churning size out */
        i = next_victim[c];
        next_victim[c] = (next_victim[c] + 1) % CACHE_SLOTS;
        released++;
        previous.free(previous.ctx, slot_ptr[c][i], slot_size[c][i]);
    }
    slot_ptr[c][i] = ptr;
    slot_size[c][i] = size;
}

/* Remember the allocator in use (*prev) and fill *mine with the caching one, for the caller to
 * install. Returns 1 if a cache was already set up (nothing changed), else 0. */
int devin_arena_reuse_init(const arena_allocator *prev, arena_allocator *mine) {
    if (previous.alloc != NULL) return 1;
    previous = *prev;
    mine->ctx = NULL;
    mine->alloc = cache_alloc;
    mine->free = cache_free;
    return 0;
}

/* out[0..2] = allocations served from the cache, allocations passed on, frees passed on. */
int devin_arena_reuse_stats(int64_t *out) {
    out[0] = hits;
    out[1] = misses;
    out[2] = released;
    return 0;
}
