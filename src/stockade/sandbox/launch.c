/* The process tier's launcher: joins the sandbox's cgroups, takes its host uid, execs bwrap.
 *
 *     launch UID N FILE... PROGRAM ARG...
 *
 * Writes "0" to each of the N files (a cgroup's `tasks` or `cgroup.procs`: the writer moves
 * itself, so everything it execs is born inside), then, unless UID is "-", drops the
 * supplementary groups and sets the real, effective and saved gid and uid to UID, then execs
 * PROGRAM with the environment it was given. One exec where the shell and nsenter made
 * three (~1.5-2 ms of a cold start). Exit 125 if a file cannot be written, 126 if the
 * credentials cannot be set, 127 if PROGRAM cannot be executed: each with a line on stderr.
 *
 * Freestanding (no C library: system calls inline, its own _start), like the exec judge.
 * x86_64 only; without it (no compiler, another machine) the tier keeps the shell's way.
 */

typedef unsigned long u64;
typedef long i64;

#define SYS_write 1
#define SYS_close 3
#define SYS_execve 59
#define SYS_exit 60
#define SYS_setresuid 117
#define SYS_setresgid 119
#define SYS_setgroups 116
#define SYS_openat 257
#define AT_FDCWD (-100)
#define O_WRONLY 01
#define O_CLOEXEC 02000000

static i64 sc(i64 nr, i64 a, i64 b, i64 c, i64 d) {
    i64 ret;
    register i64 r10 __asm__("r10") = d;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(nr), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
    return ret;
}

static u64 length(const char *s) {
    u64 n = 0;
    while (s[n]) n++;
    return n;
}

static int fail(const char *what, const char *name, int status) {
    sc(SYS_write, 2, (i64)"stockade launch: ", 17, 0);
    sc(SYS_write, 2, (i64)what, (i64)length(what), 0);
    sc(SYS_write, 2, (i64)name, (i64)length(name), 0);
    sc(SYS_write, 2, (i64)"\n", 1, 0);
    return status;
}

/* A decimal number, or -1 if the word is not one (or too large for an id). */
static i64 number(const char *s) {
    i64 n = 0;
    if (!*s) return -1;
    for (; *s; s++) {
        if (*s < '0' || *s > '9' || n > 0xFFFFFFFFL / 10) return -1;
        n = n * 10 + (*s - '0');
    }
    return n > 0xFFFFFFFEL ? -1 : n;
}

__attribute__((used)) int launch(i64 *stack) {
    i64 argc = stack[0];
    char **argv = (char **)(stack + 1);
    char **envp = argv + argc + 1;
    if (argc < 4) return fail("usage: launch UID N FILE... PROGRAM ARG...", "", 2);
    int drop = !(argv[1][0] == '-' && !argv[1][1]); /* "-": keep ours */
    i64 uid = drop ? number(argv[1]) : -1;
    i64 files = number(argv[2]);
    if ((drop && uid < 0) || files < 0 || files > argc - 4) return fail("bad arguments after ", argv[0], 2);
    for (i64 i = 0; i < files; i++) {
        const char *path = argv[3 + i];
        i64 fd = sc(SYS_openat, AT_FDCWD, (i64)path, O_WRONLY | O_CLOEXEC, 0);
        if (fd < 0) return fail("cannot open ", path, 125);
        i64 wrote = sc(SYS_write, fd, (i64)"0", 1, 0);
        sc(SYS_close, fd, 0, 0, 0);
        if (wrote != 1) return fail("cannot join ", path, 125);
    }
    if (drop) {
        if (sc(SYS_setgroups, 0, 0, 0, 0) < 0 || sc(SYS_setresgid, uid, uid, uid, 0) < 0 ||
            sc(SYS_setresuid, uid, uid, uid, 0) < 0)
            return fail("cannot take the uid ", argv[1], 126);
    }
    char **program = argv + 3 + files;
    sc(SYS_execve, (i64)program[0], (i64)program, (i64)envp, 0);
    return fail("cannot execute ", program[0], 127);
}

__attribute__((naked, noreturn)) void _start(void) {
    __asm__ volatile(
        "xor %rbp, %rbp\n"
        "mov %rsp, %rdi\n"
        "and $-16, %rsp\n"
        "call launch\n"
        "mov %eax, %edi\n"
        "mov $60, %eax\n"
        "syscall\n");
}
