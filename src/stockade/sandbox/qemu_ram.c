/* Preloaded into a jailed QEMU 7.2 that maps a snapshot's RAM file privately (copy on write):
 * it opens that file O_RDWR although it never writes it (QEMU 8.2's rom=on fixes that), and
 * the jail mounts it read-only, with no capability to override the store's 0400. An open of
 * exactly the path in STOCKADE_QEMU_RAM for reading and writing is made for reading only: a
 * private writable mapping needs no more. Every other open is left as it is. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static const char *ram;

__attribute__((constructor)) static void init(void) { ram = getenv("STOCKADE_QEMU_RAM"); }

static int flags_for(const char *path, int flags) {
    if (ram && path && (flags & O_ACCMODE) == O_RDWR && !(flags & O_CREAT) && strcmp(path, ram) == 0)
        return (flags & ~O_ACCMODE) | O_RDONLY;
    return flags;
}

static mode_t mode_of(int flags, va_list ap) {
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(ap, mode_t) : 0;
}

#define OPEN(name)                                                              \
    int name(const char *path, int flags, ...) {                                \
        static int (*next)(const char *, int, ...);                            \
        va_list ap;                                                             \
        va_start(ap, flags);                                                    \
        mode_t mode = mode_of(flags, ap);                                       \
        va_end(ap);                                                             \
        if (!next) next = (int (*)(const char *, int, ...))dlsym(RTLD_NEXT, #name); \
        return next(path, flags_for(path, flags), mode);                        \
    }

#define OPENAT(name)                                                            \
    int name(int dir, const char *path, int flags, ...) {                       \
        static int (*next)(int, const char *, int, ...);                        \
        va_list ap;                                                             \
        va_start(ap, flags);                                                    \
        mode_t mode = mode_of(flags, ap);                                       \
        va_end(ap);                                                             \
        if (!next) next = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, #name); \
        return next(dir, path, flags_for(path, flags), mode);                   \
    }

/* The checked forms _FORTIFY_SOURCE compiles an open without a mode to (QEMU's RAM file). */
#define OPEN_2(name)                                                            \
    int name(const char *path, int flags) {                                     \
        static int (*next)(const char *, int);                                  \
        if (!next) next = (int (*)(const char *, int))dlsym(RTLD_NEXT, #name);  \
        return next(path, flags_for(path, flags));                              \
    }

OPEN(open)
OPEN(open64)
OPENAT(openat)
OPENAT(openat64)
OPEN_2(__open_2)
OPEN_2(__open64_2)
