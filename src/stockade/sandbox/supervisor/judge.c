/* The exec judge's fast path: a thread of the supervisor, in C, that answers the execs the
 * rules allow whatever their arguments, so that the common exec never wakes Python.
 *
 * It owns the seccomp listener (supervisor/fastjudge.py starts it on a thread of its own, with the
 * GIL released). For each exec it reads the path and argv from the caller's memory, as the
 * Python judge does (the memory opened first, then the notification checked still valid, so
 * that what is read is the caller's own), and answers CONTINUE only when no name the program
 * goes by can match any deny or approve rule: the path's name, the name of the file it leads
 * to, argv[0]'s name; not a copy of a program a rule names (no file of that size), not
 * `python -m`, and under an allowlist a file the allowlist names alone (by its device and
 * inode, never by a name it goes by: a link /tmp/pip3 -> python3 is python3). Before it answers,
 * the exec's record (path and argv) goes into a pipe the supervisor drains when the job ends:
 * a record that cannot be written whole is not dropped, the exec goes to Python instead.
 * Everything else, and anything it cannot read or is unsure of, goes to the Python judge
 * unchanged (the notification itself, on another pipe). Names with bytes outside ASCII and
 * patterns with a bracket go to Python too: its glob rules (one character, not one byte)
 * decide those.
 *
 * Freestanding: no libc (system calls inline), so that one build loads on any image's
 * python, whatever its C library. x86_64 only, like the listener itself.
 */

typedef unsigned long u64;
typedef long i64;
typedef unsigned int u32;
typedef int i32;

#define SYS_read 0
#define SYS_write 1
#define SYS_close 3
#define SYS_stat 4
#define SYS_lstat 6
#define SYS_fstat 5
#define SYS_poll 7
#define SYS_rt_sigprocmask 14
#define SYS_ioctl 16
#define SYS_pread64 17
#define SYS_mmap 9
#define SYS_munmap 11
#define SYS_madvise 28
#define SYS_getpid 39
#define SYS_execve 59
#define SYS_wait4 61
#define SYS_fcntl 72
#define SYS_dup2 33
#define SYS_setsid 112
#define SYS_rt_sigaction 13
#define SYS_clone 56
#define SYS_exit 60
#define SYS_getsid 124
#define SYS_waitid 247
#define SYS_openat 257
#define SYS_openat2 437
#define SYS_statx 332
#define AT_SYMLINK_NOFOLLOW 0x100
#define STATX_ATTR_MOUNT_ROOT 0x2000
#define SYS_readlinkat 267
#define SYS_prctl 157
#define SYS_mkdir 83
#define SYS_seccomp 317
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#define PR_SET_DUMPABLE 4
#define PR_SET_CHILD_SUBREAPER 36

#define AT_FDCWD (-100)
#define O_RDONLY 0
#define O_NONBLOCK 04000
#define O_NOCTTY 0400
#define O_CLOEXEC 02000000
#define O_PATH 010000000
#define O_NOFOLLOW 0400000
#define RESOLVE_NO_MAGICLINKS 0x02
#define O_DIRECTORY 0200000
#define MADV_DONTFORK 10
#define S_IFMT 0170000
#define S_IFLNK 0120000
#define MAX_HOPS 8 /* symlinks followed by name before the slow way (readlink of the fd) */
#define ENOENT 2
#define ENOTDIR 20
#define EXDEV 18
#define EMFILE 24
#define EINVAL 22
#define ENOSYS 38
#define EINTR 4
#define POLLIN 1
#define P_PID 1
#define WNOHANG 1
#define WEXITED 4
#define WNOWAIT 0x01000000
#define WALL_ 0x40000000 /* __WALL: whatever signal the child ends with */

#define NOTIF_RECV 0xC0502100UL
#define NOTIF_SEND 0xC0182101UL
#define NOTIF_ID_VALID 0x40082102UL
#define NOTIF_SET_FLAGS 0x40082104UL
#define FLAG_CONTINUE 1
#define NR_EXECVE 59

#define MAX_PATTERNS 512
#define MAX_SIZES 512
#define MAX_DIRS 16
#define MAX_INTERPRETERS 32 /* execruns.INTERPRETERS, with room */
#define MAX_ARGS 4096
#define RECORD_MAX 4096 /* PIPE_BUF: a write this size is whole or not at all */
#define RECORD_FILE 0x80000000u /* in a record's count of words: the file that ran follows */
#define CONFIG_MAX 65536
#define STACK_SIZE (256 * 1024)
/* A thread of the supervisor's process: its memory, files, handlers (all signals blocked). */
#define THREAD_FLAGS (0x100 | 0x200 | 0x400 | 0x800 | 0x10000 | 0x40000)
#define PATH_MAX_ 4096

struct notif {
    u64 id;
    u32 pid;
    u32 flags;
    i32 nr;
    u32 arch;
    u64 ip;
    u64 args[6];
};

struct resp {
    u64 id;
    i64 val;
    i32 error;
    u32 flags;
};

struct pollfd_ {
    i32 fd;
    short events;
    short revents;
};

static inline long sc(long n, long a, long b, long c, long d, long e, long f)
{
    long ret;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    register long r9 __asm__("r9") = f;
    __asm__ volatile("syscall"
                     : "=a"(ret)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8), "r"(r9)
                     : "rcx", "r11", "memory");
    return ret;
}

/* What the compiler may call for struct copies and zeroing. */
__attribute__((visibility("hidden"))) void *memset(void *d, int c, unsigned long n)
{
    unsigned char *p = d;
    while (n--)
        *p++ = (unsigned char)c;
    return d;
}

__attribute__((visibility("hidden"))) void *memcpy(void *d, const void *s, unsigned long n)
{
    unsigned char *p = d;
    const unsigned char *q = s;
    while (n--)
        *p++ = *q++;
    return d;
}

static unsigned long slen(const char *s)
{
    unsigned long n = 0;
    while (s[n])
        n++;
    return n;
}

static int starts(const char *s, const char *prefix)
{
    while (*prefix)
        if (*s++ != *prefix++)
            return 0;
    return 1;
}

static int same(const char *a, const char *b)
{
    while (*a && *a == *b)
        a++, b++;
    return *a == *b;
}

static char *put_num(char *out, u64 v)
{
    char tmp[24];
    int n = 0;
    do
        tmp[n++] = (char)('0' + v % 10);
    while (v /= 10);
    while (n)
        *out++ = tmp[--n];
    *out = 0;
    return out;
}

static const char *base(const char *path)
{
    const char *b = path;
    for (; *path; path++)
        if (*path == '/')
            b = path + 1;
    return b;
}

/* -- the rules, as the supervisor hands them over ---------------------------------------- */

struct rules {
    const char *named[MAX_PATTERNS]; /* the programs of every deny and approve rule */
    int n_named;
    const char *listed[MAX_PATTERNS]; /* the files an allowlist's rules of one word allow */
    int n_listed;
    u64 listed_ids[MAX_PATTERNS][2];   /* their device and inode (find_sizes), 0 0: none */
    int allowlist;                     /* an allowlist is in force */
    u64 sizes[MAX_SIZES];              /* sizes of the programs whose copies are judged */
    int n_sizes;
    const char *dirs[MAX_DIRS];        /* where the programs named below are looked for */
    int n_dirs;
    const char *programs[MAX_PATTERNS]; /* programs whose sizes are found (find_sizes) */
    int n_programs;
    const char *interpreters[MAX_INTERPRETERS]; /* programs that run a script file they are given */
    int n_interpreters;
    const char *image[MAX_DIRS];        /* the image's folders, which code cannot write */
    int n_image;
    int max_argv;                      /* argv words a record keeps */
    int ok;
};

static u64 parse_num(const char *s)
{
    u64 v = 0;
    while (*s >= '0' && *s <= '9')
        v = v * 10 + (u64)(*s++ - '0');
    return v;
}

/* Entries separated by NULs, each a letter and its text: P a deny/approve program, F the
 * path of a file an allowlist's rule of one word allows (fastjudge.judge_config), L an allowlist
 * is in force, S a program size, M the argv kept, D a folder of programs, N a program whose size (in each D folder) is one (find_sizes), T a
 * program (a glob) that runs a script file it is given (execruns.INTERPRETERS) and G a
 * folder of the image (execruns.IMAGE_FOLDERS). */
static void parse(struct rules *r, const char *cfg, int len)
{
    const char *end = cfg + len;
    r->n_named = r->n_listed = r->n_sizes = r->allowlist = r->n_dirs = r->n_programs = 0;
    r->n_interpreters = r->n_image = 0;
    r->max_argv = 64;
    r->ok = 1;
    while (cfg < end) {
        const char *text = cfg + 1;
        switch (*cfg) {
        case 'P':
            if (r->n_named == MAX_PATTERNS)
                r->ok = 0;
            else
                r->named[r->n_named++] = text;
            break;
        case 'F':
            if (r->n_listed == MAX_PATTERNS)
                r->ok = 0;
            else
                r->listed[r->n_listed++] = text;
            break;
        case 'L':
            r->allowlist = 1;
            break;
        case 'S':
            if (r->n_sizes == MAX_SIZES)
                r->ok = 0;
            else
                r->sizes[r->n_sizes++] = parse_num(text);
            break;
        case 'M':
            r->max_argv = (int)parse_num(text);
            break;
        case 'D':
            if (r->n_dirs == MAX_DIRS)
                r->ok = 0;
            else
                r->dirs[r->n_dirs++] = text;
            break;
        case 'N':
            if (r->n_programs == MAX_PATTERNS)
                r->ok = 0;
            else
                r->programs[r->n_programs++] = text;
            break;
        case 'T':
            if (r->n_interpreters == MAX_INTERPRETERS)
                r->ok = 0;
            else
                r->interpreters[r->n_interpreters++] = text;
            break;
        case 'G':
            if (r->n_image == MAX_DIRS)
                r->ok = 0;
            else
                r->image[r->n_image++] = text;
            break;
        default:
            r->ok = 0; /* something this build does not know: judge nothing here */
        }
        cfg += slen(cfg) + 1;
    }
}

/* The sizes of the N programs in the D folders, as rulespy.program_sizes finds them for the
 * Python judge (os.stat of os.path.join(folder, name), a glob skipped): a file of another
 * size is no copy of one. Done by the judge's thread before its first exec, beside the
 * supervisor's start rather than in it. */
static void find_sizes(struct rules *r, char *path, long cap)
{
    u64 st[18];
    /* The allowlist's files, by what they are: an exec is allowed by its file's identity,
     * never by the name it was given (a link /tmp/pip3 -> python3). One not there: none. */
    for (int i = 0; i < r->n_listed; i++) {
        r->listed_ids[i][0] = r->listed_ids[i][1] = 0;
        if (sc(SYS_stat, (long)r->listed[i], (long)st, 0, 0, 0, 0) == 0) {
            r->listed_ids[i][0] = st[0];
            r->listed_ids[i][1] = st[1];
        }
    }
    for (int d = 0; d < r->n_dirs; d++)
        for (int i = 0; i < r->n_programs; i++) {
            const char *name = r->programs[i], *p;
            int globbed = 0;
            for (p = name; *p; p++)
                if (*p == '*' || *p == '?' || *p == '[')
                    globbed = 1;
            if (globbed)
                continue;
            unsigned long dl = slen(r->dirs[d]), nl = slen(name);
            if (name[0] == '/') { /* os.path.join drops the folder before an absolute name */
                if ((long)nl + 1 > cap)
                    continue;
                memcpy(path, name, nl + 1);
            } else {
                if ((long)(dl + nl + 2) > cap)
                    continue;
                memcpy(path, r->dirs[d], dl);
                long at = (long)dl;
                if (dl == 0 || r->dirs[d][dl - 1] != '/')
                    path[at++] = '/';
                memcpy(path + at, name, nl + 1);
            }
            if (sc(SYS_stat, (long)path, (long)st, 0, 0, 0, 0) != 0)
                continue;
            if (r->n_sizes == MAX_SIZES) {
                r->ok = 0; /* more than it holds: judge nothing here */
                return;
            }
            r->sizes[r->n_sizes++] = st[6];
        }
}

enum { NO = 0, YES = 1, MAYBE = 2 };

/* fnmatch.fnmatchcase over an ASCII name: '*' and '?'; a bracket is Python's to judge. */
static int glob(const char *name, const char *pat)
{
    const char *p;
    for (p = pat; *p; p++)
        if (*p == '[')
            return MAYBE;
    const char *star = 0, *resume = 0;
    while (*name) {
        if (*pat == '*') {
            star = pat++;
            resume = name;
        } else if (*pat && (*pat == '?' || *pat == *name)) {
            pat++;
            name++;
        } else if (star) {
            pat = star + 1;
            name = ++resume;
        } else {
            return NO;
        }
    }
    while (*pat == '*')
        pat++;
    return *pat ? NO : YES;
}

static int ascii(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s >= 0x80)
            return 0;
    return 1;
}

/* Whether the Python judge could say anything but "allow" of a program by these names,
 * whatever its arguments: 1 when it surely allows (then the exec runs at once). */
__attribute__((visibility("default"))) int stockade_fast_allows(const char *cfg, int len,
                                                                 const char *path_name,
                                                                 const char *file_name,
                                                                 const char *argv0, const char *argv1,
                                                                 int argc, u64 size, u64 dev, u64 ino);

/* Whether ``name`` may be the program ``pat`` under another name: with a version (pip3,
 * python3.11) or as a dashed git command (git-push), which execrules.rule_names files under
 * ``pat``; Python judges it. */
static int extends(const char *name, const char *pat)
{
    if (starts(name, pat)) {
        char next = name[slen(pat)];
        if ((next >= '0' && next <= '9') || next == '.' || next == '-')
            return 1;
    }
    /* The names rule_names gives, matched as the rule's glob matches them (g?t is git's). */
    if (starts(name, "git-") && name[4] && glob("git", pat) != NO)
        return 1;
    char bare[256];
    unsigned long n = slen(name);
    if (n >= sizeof bare)
        return 1; /* Python judges it */
    while (n > 0 && ((name[n - 1] >= '0' && name[n - 1] <= '9') || name[n - 1] == '.'))
        n--;
    if (n == 0 || name[n] == 0)
        return 0;
    for (unsigned long i = 0; i < n; i++)
        bare[i] = name[i];
    bare[n] = 0;
    return glob(bare, pat) != NO;
}

/* Whether a program of this name runs a script file it is given (execruns.script_run). */
static int interpreter(const struct rules *r, const char *name)
{
    for (int i = 0; i < r->n_interpreters; i++)
        if (glob(name, r->interpreters[i]) != NO) /* a bracket: Python's to read */
            return 1;
    return 0;
}

/* The file (device ``dev``, inode ``ino``) is one an allowlist's rule of one word allows. */
static int listed(const struct rules *r, u64 dev, u64 ino)
{
    for (int i = 0; i < r->n_listed; i++)
        if (r->listed_ids[i][1] == ino && r->listed_ids[i][0] == dev && (dev || ino))
            return 1;
    return 0;
}

static int allows(const struct rules *r, const char *names[3], int n_names, const char *argv1, int argc,
                  u64 size, u64 dev, u64 ino)
{
    int i, j;
    if (!r->ok)
        return 0;
    for (i = 0; i < n_names; i++)
        if (!ascii(names[i]))
            return 0;
    /* An interpreter given a script or a module (python3 -m) is judged as what it runs too
     * (execruns.script_run, execruns.subject): any first argument but -c is Python's to
     * read (sh -c, python3 -c: answered here). */
    if (argc > 1 && !same(argv1, "-c"))
        for (i = 0; i < n_names; i++)
            if (interpreter(r, base(names[i])))
                return 0;
    for (i = 0; i < r->n_sizes; i++)
        if (r->sizes[i] == size)
            return 0; /* it may be a copy of a program a rule names */
    for (i = 0; i < n_names; i++)
        for (j = 0; j < r->n_named; j++)
            if (glob(names[i], r->named[j]) != NO || extends(names[i], r->named[j]))
                return 0;
    if (r->allowlist)
        return listed(r, dev, ino); /* what the file is, never a name it goes by */
    return 1;
}

int stockade_fast_allows(const char *cfg, int len, const char *path_name, const char *file_name,
                         const char *argv0, const char *argv1, int argc, u64 size, u64 dev, u64 ino)
{
    static struct rules r; /* for the tests only: one caller at a time */
    static char path[PATH_MAX_ + 8];
    const char *names[3] = {path_name, file_name, argc > 0 ? base(argv0) : ""};
    parse(&r, cfg, len);
    find_sizes(&r, path, sizeof path);
    return allows(&r, names, argc > 0 ? 3 : 2, argv1, argc, size, dev, ino);
}

/* -- one exec ----------------------------------------------------------------------------- */

struct ctx {
    struct rules rules;
    int listener, forward_fd, record_fd, control;
    int proc; /* /proc, held: each look-up of a caller starts there, not at the root */
    char record[RECORD_MAX];
    char path[PATH_MAX_ + 8];
    char real[PATH_MAX_ + 8];
    char scratch[PATH_MAX_ + 64];
    char link[PATH_MAX_ + 8];
    u64 pointers[512];
    /* The rest of the caller's page read last (one exec's: emptied before each): an exec's
     * words are most often side by side (a shell's, or Python's small strings, share a page),
     * so that one read serves its path and argv where one a word was made. */
    u64 window_at;
    long window_len;
    char window[4096];
};

/* A NUL-ended string from the caller's memory into out[0..cap); its length, or -1. */
static long read_string(struct ctx *c, int mem, u64 at, char *out, long cap)
{
    long got = 0;
    if (!(c->window_len > 0 && at >= c->window_at && at - c->window_at < (u64)c->window_len)) {
        long want = 4096 - (long)(at % 4096); /* to the end of its page: never a fault */
        long n = sc(SYS_pread64, mem, (long)c->window, want, (long)at, 0, 0);
        if (n <= 0)
            return -1;
        c->window_at = at;
        c->window_len = n;
    }
    long from = (long)(at - c->window_at);
    for (long i = from; i < c->window_len && i - from < cap; i++)
        if (c->window[i] == 0) {
            memcpy(out, c->window + from, (unsigned long)(i - from + 1));
            return i - from;
        }
    got = c->window_len - from; /* no end in the window: the rest read the old way */
    if (got >= cap)
        return -1;
    memcpy(out, c->window + from, (unsigned long)got);
    while (got < cap) { /* from a page's start on: whole pages */
        long want = 4096 - (long)((at + (u64)got) % 4096);
        if (want > cap - got)
            want = cap - got;
        long n = sc(SYS_pread64, mem, (long)(out + got), want, (long)(at + (u64)got), 0, 0);
        if (n <= 0)
            return -1;
        for (long i = 0; i < n; i++)
            if (out[got + i] == 0)
                return got + i;
        got += n;
    }
    return -1;
}

/* Whether an absolute path is already what os.path.normpath makes of it: no empty, "." or
 * ".." part after its leading "/". */
static int normal(const char *path)
{
    const char *part = path + 1, *p;
    for (p = part;; p++) {
        if (*p == '/' || *p == 0) {
            long n = p - part;
            if (n == 0 || (n == 1 && part[0] == '.') || (n == 2 && part[0] == '.' && part[1] == '.'))
                return 0;
            if (*p == 0)
                return 1;
            part = p + 1;
        }
    }
}

static void forward(struct ctx *c, const struct notif *n)
{
    const char *p = (const char *)n;
    long left = sizeof *n;
    while (left > 0) {
        long w = sc(SYS_write, c->forward_fd, (long)p, left, 0, 0, 0);
        if (w == -EINTR)
            continue;
        if (w <= 0)
            return; /* the supervisor is gone */
        p += w;
        left -= w;
    }
}

static void answer(struct ctx *c, u64 id, int error)
{
    struct resp r;
    r.id = id;
    r.val = 0;
    r.error = error ? -error : 0;
    r.flags = error ? 0 : FLAG_CONTINUE;
    sc(SYS_ioctl, c->listener, (long)NOTIF_SEND, (long)&r, 0, 0, 0);
}

/* Whether ``pid`` is a child of this process (of any of its threads: a shim of the
 * supervisor's), exited or not: waitid without reaping it (WNOWAIT), so that the supervisor's
 * own reaping finds it as before. One system call, where reading its parent from
 * /proc/PID/stat took three and a lookup in /proc (~15% of the judging of an exec). */
static int ours(long pid)
{
    u64 info[16]; /* a siginfo_t, 128 bytes */
    return sc(SYS_waitid, P_PID, pid, (long)info, WEXITED | WNOHANG | WNOWAIT | WALL_, 0, 0) == 0;
}

/* openat2(2)'s how: the flags, the mode, and how the path may be resolved. */
struct open_how_ {
    u64 flags, mode, resolve;
};

/* openat2 of ``path`` as an O_PATH descriptor that crosses no magic link (/proc/PID/fd/N,
 * cwd, root, exe): what such a link leads to is the process's that follows it, and the
 * judge is not the caller. ``nofollow``: the last name itself if it is a link. */
static long no_magic_open(const char *path, int nofollow)
{
    struct open_how_ how = {O_PATH | O_CLOEXEC | (nofollow ? O_NOFOLLOW : 0), 0, RESOLVE_NO_MAGICLINKS};
    return sc(SYS_openat2, AT_FDCWD, (long)path, (long)&how, sizeof how, 0, 0);
}

/* lstat(2), crossing no magic link: 0, or minus an errno. */
static long no_magic_lstat(const char *path, u64 *st)
{
    long fd = no_magic_open(path, 1);
    if (fd < 0)
        return fd;
    long r = sc(SYS_fstat, fd, (long)st, 0, 0, 0, 0);
    sc(SYS_close, fd, 0, 0, 0, 0, 0);
    return r;
}

/* Whether ``path`` (the file's, links followed) is in one of the image's folders, which code
 * cannot write (the G entries: execruns.IMAGE_FOLDERS). */
static int in_image(const struct rules *r, const char *path)
{
    for (int i = 0; i < r->n_image; i++)
        if (starts(path, r->image[i]))
            return 1;
    return 0;
}

/* Whether ``path`` (normal) names a file right in one of the image's program folders (the D
 * entries: fastjudge.PROGRAM_DIRS): the folders on its way are the image's, which code cannot
 * make links in, so no magic link is crossed before its name (the look of every PATH
 * search, kept to one system call). */
static int in_program_folder(const struct rules *r, const char *path)
{
    const char *name = base(path);
    for (int d = 0; d < r->n_dirs; d++) {
        unsigned long dl = slen(r->dirs[d]);
        if ((unsigned long)(name - path) == dl + 1 && starts(path, r->dirs[d]) && path[dl] == '/')
            return 1;
    }
    return 0;
}

/* Whether the file at ``path`` (no magic link on the way) may be a script: it begins with
 * "#!", or cannot be read to tell. */
static int script(const char *path)
{
    struct open_how_ how = {O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0, RESOLVE_NO_MAGICLINKS};
    long fd = sc(SYS_openat2, AT_FDCWD, (long)path, (long)&how, sizeof how, 0, 0);
    if (fd < 0)
        return 1;
    char head[2] = {0, 0};
    long got = sc(SYS_read, fd, (long)head, 2, 0, 0, 0);
    sc(SYS_close, fd, 0, 0, 0, 0, 0);
    return got != 2 || (head[0] == '#' && head[1] == '!');
}

/* The file an absolute, normal path leads to, found by name while each link on the way is a
 * name in its own folder (sh -> dash): then realpath's last part, which is all the judge
 * reads of it, is that of the last link's target, and lstat gives its size. Three system
 * calls for /bin/sh where the slow way (open, fstat, readlink of the fd, close) walks
 * /proc too. 1: c->real holds a path of the file (its name is the file's) and *size, *dev
 * and *ino are set; 0: anything else (a link with a slash in it, a missing file, too many links), for
 * the slow way to decide. */
static int by_name(struct ctx *c, long len, u64 *size, u64 *dev, u64 *ino)
{
    u64 st[18];
    char *p = c->real;
    memcpy(p, c->path, (unsigned long)len + 1);
    for (int hop = 0;; hop++) {
        /* A look through a magic link (a folder linked to /proc/self/cwd, /dev/fd) would be
         * ours, not the caller's: refused there, for Python's walk. The later looks only
         * change the last name, in a folder already looked through. */
        int plain = hop > 0 || in_program_folder(&c->rules, p);
        if ((plain ? sc(SYS_lstat, (long)p, (long)st, 0, 0, 0, 0) : no_magic_lstat(p, st)) != 0)
            return 0;
        if (((u32)st[3] & S_IFMT) != S_IFLNK) {
            *size = st[6];
            *dev = st[0];
            *ino = st[1];
            return 1;
        }
        if (hop == MAX_HOPS)
            return 0;
        long m = sc(SYS_readlinkat, AT_FDCWD, (long)p, (long)c->link, PATH_MAX_, 0, 0);
        if (m <= 0 || m >= PATH_MAX_)
            return 0;
        c->link[m] = 0;
        for (long i = 0; i < m; i++)
            if (c->link[i] == '/')
                return 0; /* another folder: the kernel's walk, not ours */
        if (same(c->link, ".") || same(c->link, ".."))
            return 0;
        char *name = (char *)base(p); /* the link's folder stays, its name is replaced */
        if ((name - p) + m >= PATH_MAX_)
            return 0;
        memcpy(name, c->link, (unsigned long)m + 1);
    }
}

/* 1: answered here; 0: the Python judge must see it. */
static int judge(struct ctx *c, const struct notif *n)
{
    if (n->nr != NR_EXECVE)
        return 0;
    long pid = (long)n->pid;
    char *s = c->scratch;
    char *e = put_num(s, (u64)pid); /* PID/..., beneath the /proc we hold */
    memcpy(e, "/mem", 5);
    long mem = sc(SYS_openat, c->proc, (long)s, O_RDONLY | O_CLOEXEC, 0, 0, 0);
    if (mem < 0)
        return 0;
    int done = 0;
    /* The memory is the caller's only if the notification is still waiting after the open
     * (a pid that died and came back as another process fails this). */
    if (sc(SYS_ioctl, c->listener, (long)NOTIF_ID_VALID, (long)&n->id, 0, 0, 0) != 0)
        goto out;
    c->window_len = 0; /* another caller's memory */
    long len = read_string(c, (int)mem, n->args[0], c->path, PATH_MAX_);
    if (len < 0)
        goto out;
    if (c->path[0] != '/') {
        /* Relative to the caller's working folder, as os.path.join(readlink(cwd), path). */
        if (len == 0)
            goto out;
        memcpy(e, "/cwd", 5);
        long m = sc(SYS_readlinkat, c->proc, (long)s, (long)c->real, PATH_MAX_, 0, 0);
        if (m <= 0 || c->real[0] != '/' || m + 1 + len >= PATH_MAX_)
            goto out;
        if (m == 1)
            m = 0; /* the root: "/" + path */
        c->real[m] = '/';
        memcpy(c->real + m + 1, c->path, (unsigned long)len + 1);
        memcpy(c->path, c->real, (unsigned long)(m + 1 + len + 1));
        len = m + 1 + len;
    }
    if (!normal(c->path) || starts(c->path, "/proc/"))
        goto out;
    u64 size = 0, dev = 0, ino = 0;
    if (!by_name(c, len, &size, &dev, &ino)) {
        /* The slow way: the file itself, opened, and the path the kernel gives it. */
        long fd = no_magic_open(c->path, 0); /* a magic link on the way: Python's walk */
        if (fd == -ENOENT || fd == -ENOTDIR) {
            /* What the kernel would say; a PATH search goes on to its next folder. Nothing
             * runs, nothing is recorded, as in the Python judge. */
            answer(c, n->id, ENOENT);
            done = 1;
            goto out;
        }
        if (fd < 0)
            goto out;
        u64 st[18];
        long ok = sc(SYS_fstat, fd, (long)st, 0, 0, 0, 0);
        memcpy(s, "self/fd/", 8);
        put_num(s + 8, (u64)fd);
        long m = sc(SYS_readlinkat, c->proc, (long)s, (long)c->real, PATH_MAX_, 0, 0);
        sc(SYS_close, fd, 0, 0, 0, 0, 0);
        if (ok != 0 || m <= 0 || m >= PATH_MAX_)
            goto out;
        c->real[m] = 0;
        static const char deleted[] = " (deleted)";
        if (m >= (long)sizeof deleted - 1 && same(c->real + m - (sizeof deleted - 1), deleted))
            goto out;
        size = st[6];
        dev = st[0];
        ino = st[1];
    }
    /* Under rules over argv (the rule programs' sizes are known), a file outside the image's
     * folders may be a rule program's copy changed by a byte: Python compares build IDs. */
    if (c->rules.n_sizes && !in_image(&c->rules, c->real))
        goto out;
    /* A script: the kernel runs the interpreter its first line names, with no exec of its
     * own to judge (#!/bin/rm -r). Python judges the two (execruns.interpreted). */
    if (script(c->real))
        goto out;

    /* The argv, as the record keeps it: path, then up to max_argv words, NUL-ended each. */
    char *rec = c->record;
    long at = 16;
    if (at + len + 1 > RECORD_MAX)
        goto out; /* a path too long for a record: Python's */
    memcpy(rec + at, c->path, (unsigned long)len + 1);
    at += len + 1;
    long argc = 0, kept = 0;
    const char *argv0 = "", *argv1 = "";
    u64 argv_at = n->args[1];
    while (argv_at && argc < MAX_ARGS) {
        u64 from = argv_at + 8 * (u64)argc;
        long want = argc ? (long)sizeof c->pointers : 128; /* most argvs are short */
        long to_page = 4096 - (long)(from % 4096);         /* one page of the caller's a read */
        if (want > to_page && to_page >= 8)
            want = to_page;
        long got = sc(SYS_pread64, mem, (long)c->pointers, want, (long)from, 0, 0);
        if (got < 8)
            goto out;
        long count = got / 8, i, end = 0;
        for (i = 0; i < count; i++) {
            if (!c->pointers[i]) {
                end = 1;
                break;
            }
            if (kept < c->rules.max_argv) {
                long l = read_string(c, (int)mem, c->pointers[i], rec + at, RECORD_MAX - at);
                if (l < 0)
                    goto out; /* too long for a record: Python's */
                if (kept == 0)
                    argv0 = rec + at;
                if (kept == 1)
                    argv1 = rec + at;
                at += l + 1;
                kept++;
            }
            argc++;
        }
        if (end)
            break;
    }
    if (argc > kept && kept < 2)
        goto out; /* a record too short to judge by: Python's */
    const char *names[3] = {base(c->path), base(c->real), base(argv0)};
    if (!allows(&c->rules, names, argc > 0 ? 3 : 2, argv1, (int)argc, size, dev, ino))
        goto out;
    /* The job is known from the session its shim leads (a child of ours); a process that
     * left it is Python's to place, walking its parents while it lives. */
    long sid = sc(SYS_getsid, pid, 0, 0, 0, 0, 0);
    if (sid <= 0 || !ours(sid))
        goto out;
    u32 words = (u32)kept;
    if (!same(c->path, c->real)) {
        /* The file that ran, where the path led to another (RECORD_FILE: its last word). */
        long m = slen(c->real);
        if (at + m + 1 > RECORD_MAX)
            goto out; /* Python's */
        memcpy(rec + at, c->real, (unsigned long)m + 1);
        at += m + 1;
        words |= RECORD_FILE;
    }
    u32 head[4] = {(u32)at, (u32)pid, (u32)sid, words};
    memcpy(rec, head, sizeof head);
    if (sc(SYS_write, c->record_fd, (long)rec, at, 0, 0, 0) != at)
        goto out; /* full: Python records it (it drains first) */
    answer(c, n->id, 0);
    done = 1;
out:
    sc(SYS_close, mem, 0, 0, 0, 0, 0);
    return done;
}

/* The pid of our own spawn's child while it execs the command shim (stockade_spawn): only
 * a task that shares this memory can have written it there, so the judge lets that exec
 * through unjudged and unrecorded (the shim's own; the command it starts is judged). */
static volatile long spawning;

static struct ctx *cp; /* mapped by stockade_judge, with the thread's stack, out of forks */
static char config[CONFIG_MAX];

/* The thread's whole life: judge until a byte arrives on ``control``, then say so with a
 * notification of id 0 on the forward pipe, and end. A listener that broke ends it too (the
 * supervisor then takes the listener back). Nothing here touches Python or the C library. */
__attribute__((visibility("hidden"), used, noinline, noreturn)) void stockade_judge_thread(void)
{
    struct notif n;
    struct ctx *c = cp;
    find_sizes(&c->rules, c->path, PATH_MAX_);
    for (;;) {
        struct pollfd_ fds[2] = {{c->listener, POLLIN, 0}, {c->control, POLLIN, 0}};
        long r = sc(SYS_poll, (long)fds, 2, -1, 0, 0, 0);
        if (r == -EINTR)
            continue;
        if (r < 0 || fds[1].revents || (fds[0].revents & ~POLLIN))
            break;
        if (!(fds[0].revents & POLLIN))
            continue;
        memset(&n, 0, sizeof n); /* the kernel refuses a buffer that is not zeroed */
        if (sc(SYS_ioctl, c->listener, (long)NOTIF_RECV, (long)&n, 0, 0, 0) != 0)
            continue; /* the caller died meanwhile */
        if (spawning && (long)n.pid == spawning) {
            answer(c, n.id, 0); /* our own spawn's child, starting a command's shim */
            continue;
        }
        if (!judge(c, &n))
            forward(c, &n);
    }
    memset(&n, 0, sizeof n);
    forward(c, &n);
    for (;;)
        sc(SYS_exit, 0, 0, 0, 0, 0, 0); /* this thread only */
}

/* clone(2) with ``flags`` onto ``stack_top``, the new task calling ``entry`` (which never
 * returns): the judge's thread, and the spawn's vfork child. Returns what clone returned
 * to us. ``entry`` rides in r12, which the kernel hands the new task as it was. */
static long clone_into(long flags, void *stack_top, void (*entry)(void))
{
    long ret;
    register long r10 __asm__("r10") = 0; /* no child tid */
    register long r8 __asm__("r8") = 0;   /* no TLS of its own: it never uses any */
    register void (*r12)(void) __asm__("r12") = entry;
    __asm__ volatile("syscall\n\t"
                     "test %%rax, %%rax\n\t"
                     "jnz 1f\n\t"
                     "xor %%ebp, %%ebp\n\t"
                     "call *%%r12\n\t"
                     "1:\n\t"
                     : "=a"(ret)
                     : "a"(SYS_clone), "D"(flags), "S"(stack_top), "d"(0), "r"(r10), "r"(r8), "r"(r12)
                     : "rcx", "r11", "memory");
    return ret;
}

/* Start the judge on a thread of this process (a raw clone: no Python thread, so no GIL
 * to hand over at start, and no C library). Returns its thread id (it never has a child:
 * the supervisor's look for strays skips it), or -1 (then nothing started). */
__attribute__((visibility("default"))) int stockade_judge(int listener, int forward_fd, int record_fd,
                                                          int control, const char *cfg, int len)
{
    if (len < 0 || len > CONFIG_MAX)
        return -1;
    /* Its working memory and stack in one mapping that forks leave out (MADV_DONTFORK):
     * after the supervisor forks a shim, every page the two share is copied at its first
     * write, and the thread wrote half a dozen (its buffers, its stack) at each exec. A
     * shim has no use for them: the thread is not in it. */
    unsigned long ctx_size = (sizeof(struct ctx) + 4095) & ~4095UL;
    long area = sc(SYS_mmap, 0, (long)(ctx_size + STACK_SIZE), 3 /* read, write */,
                   0x22 | 0x20000 /* private, anonymous, stack */, -1, 0);
    if (area < 0 && area > -4096)
        return -1;
    long proc = sc(SYS_openat, AT_FDCWD, (long)"/proc", O_PATH | O_DIRECTORY | O_CLOEXEC, 0, 0, 0);
    if (proc < 0 || sc(SYS_madvise, area, (long)(ctx_size + STACK_SIZE), MADV_DONTFORK, 0, 0, 0) != 0) {
        if (proc >= 0)
            sc(SYS_close, proc, 0, 0, 0, 0, 0);
        sc(SYS_munmap, area, (long)(ctx_size + STACK_SIZE), 0, 0, 0, 0);
        return -1;
    }
    struct ctx *c = (struct ctx *)(area + STACK_SIZE); /* above the stack, which grows away from it */
    memcpy(config, cfg, (unsigned long)len);
    parse(&c->rules, config, len);
    c->listener = listener;
    c->forward_fd = forward_fd;
    c->record_fd = record_fd;
    c->control = control;
    c->proc = (int)proc;
    cp = c;
    u64 all = ~0UL, old = 0;
    sc(SYS_rt_sigprocmask, 0 /* SIG_BLOCK */, (long)&all, (long)&old, 8, 0, 0);
    long tid = clone_into(THREAD_FLAGS, (void *)(area + STACK_SIZE), stockade_judge_thread);
    sc(SYS_rt_sigprocmask, 2 /* SIG_SETMASK */, (long)&old, 0, 8, 0, 0);
    return tid > 0 ? (int)tid : -1;
}

/* -- the rules' set-up, at the supervisor's start ------------------------------------------ */

/* Whether ``path`` (its last name not followed) is the root of a mount, as statx says; 0
 * where it cannot tell (an older kernel: the path stays checked). */
static int mount_root(const char *path)
{
    u64 stx[32]; /* struct statx, 256 bytes: stx_attributes at 8, stx_attributes_mask at 56 */
    if (sc(SYS_statx, AT_FDCWD, (long)path, AT_SYMLINK_NOFOLLOW, 0, (long)stx, 0) != 0)
        return 0;
    return (stx[7] & STATX_ATTR_MOUNT_ROOT) && (stx[1] & STATX_ATTR_MOUNT_ROOT);
}

/* What supervisor/rules.py sets up, done in one call where this library loads (in Python, each
 * of its dozen system calls costs a call prototype or a buffer class made on first use, and
 * the module that makes them an import: about 1 ms of a cold start). The same steps as
 * rules.Rules and confine.py, in the same order; the Python path stays where there is no
 * library (and for STOCKADE_EXEC_JUDGE=python). */

#define LL_FS_EXECUTE (1UL << 0)
#define LL_FS_WRITE_FILE (1UL << 1)
#define LL_FS_REMOVE_DIR (1UL << 4)
#define LL_FS_REMOVE_FILE (1UL << 5)
#define LL_FS_MAKE (0x7fUL << 6) /* char, dir, reg, sock, fifo, block, sym */
#define LL_FS_REFER (1UL << 13)
#define LL_FS_TRUNCATE (1UL << 14)
#define LL_FILE_RIGHTS (LL_FS_WRITE_FILE | LL_FS_TRUNCATE)
#define S_IFDIR 0040000
#define INODES_MAX 8192

struct bpf_insn_ {
    unsigned short code;
    unsigned char jt, jf;
    u32 k;
};
struct bpf_prog_ {
    unsigned short len;
    const struct bpf_insn_ *filter;
};
struct __attribute__((packed)) path_beneath_ {
    u64 allowed;
    i32 parent_fd;
};

/* The written paths' device and inode when the ruleset was built, as stockade_confine reads
 * them (each two u64 and the path, NUL-ended): a shim checks them before it applies it. */
static char setup_inodes[INODES_MAX];
static int setup_inodes_len;

#define SPAWN_STACK (64 * 1024)
#define SYS_getrandom 318
#define SYS_pipe2 293

/* The spawn's memory, mapped once, out of forks (MADV_DONTFORK): the child's stack, and above
 * its top the exec key. 0 once mapped; else -errno (nothing mapped). */
static long spawn_area;
static long map_spawn_area(void)
{
    if (spawn_area)
        return 0;
    long area = sc(SYS_mmap, 0, SPAWN_STACK + 4096, 3, 0x22 | 0x20000, -1, 0);
    if (area < 0 && area > -4096)
        return area;
    long r = sc(SYS_madvise, area, SPAWN_STACK + 4096, MADV_DONTFORK, 0, 0, 0);
    if (r != 0) { /* the key would be in every fork (the zygote, the code): none at all */
        sc(SYS_munmap, area, SPAWN_STACK + 4096, 0, 0, 0, 0);
        return r;
    }
    spawn_area = area;
    return 0;
}

/* The exec key: 128 random bits that the exec filter knows, held in the spawn's memory
 * alone (forks leave it out: no process of the code ever has it). An execve that carries it
 * in its unused fourth and fifth arguments is let through by the filter itself, with no
 * notification: the command shim's own exec (stockade_spawn), which the judge used to be
 * woken for only to answer it unjudged. Two context switches a command, saved. ``keyed``:
 * the filter in force was installed with the key that is there. */
static int keyed;
static u64 *exec_key(void) { return (u64 *)(spawn_area + SPAWN_STACK); }

/* Whether an exec that carries the key hides its registers from the code: the shim's file
 * cannot be read (reaper.runnable_only), so its exec leaves it non-dumpable, unless the host's
 * fs.suid_dumpable is 1 (then dumpable all the same, and any process of the code could
 * read the key from /proc/PID/syscall while the exec is under way: no key then). */
static int execs_hide_registers(void)
{
    char v[4] = {0, 0, 0, 0};
    long fd = sc(SYS_openat, AT_FDCWD, (long)"/proc/sys/fs/suid_dumpable", O_RDONLY | O_CLOEXEC, 0, 0, 0);
    if (fd < 0)
        return 1; /* no such file (gVisor's, a guest's /proc without it): the default, 0 */
    long got = sc(SYS_read, fd, (long)v, 3, 0, 0, 0);
    sc(SYS_close, fd, 0, 0, 0, 0, 0);
    return !(got >= 1 && v[0] == '1');
}

/* confine.exec_filter: execve and execveat to the listener, other architectures die; with
 * no_memfd, memfd_create fails (EPERM). And, where the key could be made, an execve that
 * carries the key runs (the comparisons below on the key's four 32-bit words). */
static long install_listener(int no_memfd)
{
    enum { ALLOW = 15, KILL = 16, NOTIF = 17, ERR = 18, LEN = 19 };
    static const struct bpf_insn_ code[LEN] = {
        {0x20, 0, 0, 4}, /* 0: the architecture */
        {0x15, 0, KILL - 2, 0xC000003E},
        {0x20, 0, 0, 0}, /* 2: the system call */
        {0x35, KILL - 4, 0, 0x40000000},
        {0x15, NOTIF - 5, 0, 322},
        {0x15, ERR - 6, 0, 322}, /* memfd_create (319) under no_memfd; else never true */
        {0x15, 0, ALLOW - 7, 59},
        {0x20, 0, 0, 40}, /* 7: execve's args[3] and args[4], the key's place: k below */
        {0x15, 0, NOTIF - 9, 0},
        {0x20, 0, 0, 44},
        {0x15, 0, NOTIF - 11, 0},
        {0x20, 0, 0, 48},
        {0x15, 0, NOTIF - 13, 0},
        {0x20, 0, 0, 52},
        {0x15, NOTIF - 15, NOTIF - 15, 0}, /* jt: ALLOW where there is a key */
        {0x06, 0, 0, 0x7FFF0000},
        {0x06, 0, 0, 0x80000000},
        {0x06, 0, 0, 0x7FC00000},
        {0x06, 0, 0, 0x00050000 | 1},
    };
    struct bpf_insn_ local[LEN];
    struct bpf_insn_ *prog = local;
    int key = execs_hide_registers() && map_spawn_area() == 0 &&
              sc(SYS_getrandom, (long)exec_key(), 16, 0, 0, 0, 0) == 16;
    if (key) /* written beside the key, out of forks: no copy of it on a stack forks copy */
        prog = (struct bpf_insn_ *)(exec_key() + 2);
    for (int i = 0; i < LEN; i++)
        prog[i] = code[i];
    if (no_memfd)
        prog[5].k = 319;
    if (key) {
        const u32 *words = (const u32 *)exec_key();
        for (int i = 0; i < 4; i++)
            prog[8 + 2 * i].k = words[i];
        prog[14].jt = ALLOW - 15;
    }
    struct bpf_prog_ fprog = {LEN, prog};
    long listener = sc(SYS_seccomp, 1 /* SET_MODE_FILTER */, 1 << 3 /* NEW_LISTENER */, (long)&fprog, 0, 0, 0);
    keyed = key && listener >= 0;
    memset(prog, 0, sizeof local);
    __asm__ volatile("" : : "r"(prog) : "memory");
    return listener;
}

/* The exec key for the supervisor a reset execs (the filter outlives our image): a pipe's
 * read end holding it, or -1 where there is none. */
__attribute__((visibility("default"))) int stockade_key_pipe(void)
{
    int fds[2];
    if (!keyed || sc(SYS_pipe2, (long)fds, O_CLOEXEC, 0, 0, 0, 0) != 0)
        return -1;
    long wrote = sc(SYS_write, fds[1], (long)exec_key(), 16, 0, 0, 0);
    sc(SYS_close, fds[1], 0, 0, 0, 0, 0);
    if (wrote != 16) {
        sc(SYS_close, fds[0], 0, 0, 0, 0, 0);
        return -1;
    }
    return fds[0];
}

/* The key a reset carried over, from the pipe ``fd`` (left open: the caller closes it). */
static void take_key(long fd)
{
    keyed = 0;
    if (map_spawn_area() == 0 && sc(SYS_read, fd, (long)exec_key(), 16, 0, 0, 0) == 16)
        keyed = 1;
}

/* os.makedirs(path, exist_ok=True), every error ignored as rules.Rules does. */
static void make_dirs(char *path)
{
    for (char *p = path + 1;; p++) {
        if (*p == '/' || *p == 0) {
            char was = *p;
            *p = 0;
            sc(SYS_mkdir, (long)path, 0777, 0, 0, 0, 0);
            *p = was;
            if (!was)
                return;
        }
    }
}

/* confine.open_written: beneath ``root`` (the workspace; NULL: none) the written ``path`` is
 * reached name by name, following no link (a link opened O_PATH | O_NOFOLLOW is the link
 * itself, and a name beneath it fails: ENOTDIR), and ".." refused; elsewhere (/tmp, /dev, an
 * allowlist's files) it is the image's, opened as it is. An O_PATH descriptor, or -errno;
 * the caller refuses a last name that is a link. */
static long open_written(const char *root, const char *path)
{
    unsigned long top = root ? slen(root) : 0;
    while (top > 0 && root[top - 1] == '/')
        top--;
    if (!root || !starts(path, root) || path[top] != '/')
        return sc(SYS_openat, AT_FDCWD, (long)path, O_PATH | O_CLOEXEC, 0, 0, 0);
    static char name[PATH_MAX_ + 8]; /* the root, then each name: both shorter than the path */
    memcpy(name, root, top);
    name[top] = 0;
    long fd = sc(SYS_openat, AT_FDCWD, (long)(top ? name : "/"), O_PATH | O_DIRECTORY | O_CLOEXEC, 0, 0, 0);
    for (const char *p = path + top; fd >= 0 && *p;) {
        const char *end = p;
        while (*end && *end != '/')
            end++;
        unsigned long n = (unsigned long)(end - p);
        if (n == 2 && p[0] == '.' && p[1] == '.') {
            sc(SYS_close, fd, 0, 0, 0, 0, 0);
            return -EXDEV;
        }
        if (n > 0 && !(n == 1 && p[0] == '.')) {
            memcpy(name, p, n);
            name[n] = 0;
            long next = sc(SYS_openat, fd, (long)name, O_PATH | O_NOFOLLOW | O_CLOEXEC, 0, 0, 0);
            sc(SYS_close, fd, 0, 0, 0, 0, 0);
            fd = next;
        }
        p = *end ? end + 1 : end;
    }
    return fd;
}

/* One grant of confine.ruleset: no rule for a path that is not there, nor for a written one
 * beneath ``root`` that is, or is reached through, a link (open_written), nor for a file
 * there with another name (a rule holds the inode: a file at ``out``, written as a folder,
 * hard-linked to a read-only file made that one writable); a file gets only the rights that
 * apply to files. */
static long grant(long ruleset, const char *root, const char *path, u64 rights)
{
    long fd = open_written(root, path);
    if (fd < 0)
        return 0;
    unsigned long top = root ? slen(root) : 0;
    while (top > 0 && root[top - 1] == '/')
        top--;
    int beneath = root && starts(path, root) && path[top] == '/';
    u64 st[18]; /* x86-64's struct stat: st_nlink at [2], st_mode in [3] */
    long r = sc(SYS_fstat, fd, (long)st, 0, 0, 0, 0);
    if (r == 0 && ((u32)st[3] & S_IFMT) != S_IFLNK) { /* a link: no rule, its target as it is */
        int dir = ((u32)st[3] & S_IFMT) == S_IFDIR;
        if (beneath && !dir && st[2] != 1) { /* a file with another name: no rule */
            sc(SYS_close, fd, 0, 0, 0, 0, 0);
            return 0;
        }
        if (!dir)
            rights &= LL_FILE_RIGHTS | LL_FS_EXECUTE;
        struct path_beneath_ rule = {rights, (i32)fd};
        r = sc(SYS_landlock_add_rule, ruleset, 1 /* PATH_BENEATH */, (long)&rule, 0, 0, 0);
    }
    sc(SYS_close, fd, 0, 0, 0, 0, 0);
    return r;
}

/* ``cfg``: NUL-ended entries, a letter and its text: C probe seccomp notification, I then
 * install the exec listener on ourselves (none was carried over a reset), X memfd_create
 * refused too (an allowlist), M a folder to make, L probe Landlock and build the ruleset, w
 * write rights handled, W a path code may write, B the workspace (a W path beneath it follows
 * no link: open_written), E a file code may run (execute handled).
 * Returns, packed: listener + 1 (bits 0-11), ruleset + 1 (12-23), the Landlock ABI (24-28),
 * notification available (29); -ENOSYS for what it does not understand (nothing done: the
 * caller does it all in Python); else -errno (a rule Landlock refused: Python raises too). */
__attribute__((visibility("default"))) int stockade_setup(const char *cfg, int len)
{
    const char *end = cfg + len, *e;
    int probe_notify = 0, install = 0, no_memfd = 0, landlock = 0, writes = 0, execs = 0;
    long inodes = 0, key_fd = -1;
    const char *root = 0; /* the workspace: a written path beneath it follows no link */
    if (len <= 0 || cfg[len - 1] != 0)
        return -ENOSYS;
    for (e = cfg; e < end; e += slen(e) + 1) {
        switch (*e) {
        case 'C': probe_notify = 1; break;
        case 'I': install = 1; break;
        case 'X': no_memfd = 1; break;
        case 'L': landlock = 1; break;
        case 'w': writes = 1; break;
        case 'E': execs = 1; break;
        case 'B':
            if (e[1] != '/' || slen(e) >= PATH_MAX_)
                return -ENOSYS;
            root = e + 1;
            break;
        case 'K':
            if (e[1] < '0' || e[1] > '9')
                return -ENOSYS;
            key_fd = 0;
            for (const char *d = e + 1; *d; d++)
                key_fd = *d >= '0' && *d <= '9' && key_fd < 100000 ? key_fd * 10 + (*d - '0') : -1;
            if (key_fd < 0)
                return -ENOSYS;
            break;
        case 'W': inodes += 16 + (long)slen(e); /* fall through */
        case 'M':
            if (slen(e) >= PATH_MAX_)
                return -ENOSYS;
            break;
        default: return -ENOSYS; /* not understood: nothing done, all of it in Python */
        }
    }
    if (inodes > INODES_MAX)
        return -ENOSYS;
    long abi = 0, notify = 0, listener = -1, ruleset = -1;
    if (landlock) {
        abi = sc(SYS_landlock_create_ruleset, 0, 0, 1 /* VERSION */, 0, 0, 0);
        if (abi < 0)
            abi = 0;
    }
    if (probe_notify) {
        u32 action = 0x7FC00000; /* SECCOMP_RET_USER_NOTIF */
        notify = sc(SYS_seccomp, 2 /* GET_ACTION_AVAIL */, 0, (long)&action, 0, 0, 0) == 0;
    }
    if (notify && install) {
        listener = install_listener(no_memfd);
        if (listener < 0)
            return (int)listener;
        u64 sync = 1; /* SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP: Linux 6.6, else the usual wake-up */
        sc(SYS_ioctl, listener, (long)NOTIF_SET_FLAGS, (long)sync, 0, 0, 0);
    } else if (key_fd >= 0) {
        take_key(key_fd); /* the listener was carried over a reset, and its key with it */
    }
    for (e = cfg; e < end; e += slen(e) + 1)
        if (*e == 'M' && e[1] == '/' && slen(e) < PATH_MAX_) {
            static char folder[PATH_MAX_ + 8];
            memcpy(folder, e + 1, slen(e));
            make_dirs(folder);
        }
    setup_inodes_len = 0;
    if (abi) {
        u64 handled = 0;
        if (writes) {
            handled = LL_FS_WRITE_FILE | LL_FS_REMOVE_DIR | LL_FS_REMOVE_FILE | LL_FS_MAKE;
            if (abi >= 2)
                handled |= LL_FS_REFER;
            if (abi >= 3)
                handled |= LL_FS_TRUNCATE;
        }
        if (execs)
            handled |= LL_FS_EXECUTE;
        ruleset = sc(SYS_landlock_create_ruleset, (long)&handled, 8, 0, 0, 0, 0);
        if (ruleset < 0)
            return (int)ruleset;
        long r = 0;
        for (e = cfg; e < end && r == 0; e += slen(e) + 1) {
            if (*e == 'W')
                r = grant(ruleset, root, e + 1, handled & ~LL_FS_EXECUTE);
            else if (*e == 'E')
                r = grant(ruleset, 0, e + 1, LL_FS_EXECUTE);
        }
        for (e = cfg; e < end && r == 0; e += slen(e) + 1) {
            u64 st[18];
            long n = (long)slen(e);
            /* The path's own inode, not a link's target: a written folder the seed replaced
             * by a link is replaced (and gets no rule), a link not replaced stays so. */
            if (*e != 'W' || sc(SYS_lstat, (long)(e + 1), (long)st, 0, 0, 0, 0) != 0)
                continue; /* room checked above */
            /* A mount's root (/tmp, /dev, /proc) is never checked again: it cannot be
             * removed or renamed over while mounted (EBUSY), and no process here mounts or
             * unmounts. Each check is an lstat before every command's start. */
            if (mount_root(e + 1))
                continue;
            memcpy(setup_inodes + setup_inodes_len, st, 16); /* st_dev, st_ino */
            memcpy(setup_inodes + setup_inodes_len + 16, e + 1, (unsigned long)n);
            setup_inodes_len += 16 + (int)n; /* the path and its NUL: n counts the letter */
            setup_inodes[setup_inodes_len - 1] = 0;
        }
        if (r != 0) {
            sc(SYS_close, ruleset, 0, 0, 0, 0, 0);
            return (int)r; /* the start fails, as Python's raise makes it */
        }
    }
    if (listener + 1 > 4095 || ruleset + 1 > 4095 || abi > 31)
        return -EMFILE; /* not said in 30 bits: the start fails (a supervisor holds a dozen) */
    return (int)((listener + 1) | (ruleset + 1) << 12 | abi << 24 | notify << 29);
}

/* -- in each shim, before the code ------------------------------------------------------ */

/* Whether a written path now leads elsewhere than when the ruleset was built (``inodes``,
 * as stockade_confine takes them; NULL: those stockade_setup found). */
static int replaced(const char *inodes, int len)
{
    if (!inodes) {
        inodes = setup_inodes;
        len = setup_inodes_len;
    }
    const char *at = inodes, *end = inodes + len;
    u64 st[18];
    while (at + 16 < end) {
        u64 want[2];
        memcpy(want, at, 16);
        const char *path = at + 16;
        at = path + slen(path) + 1;
        if (sc(SYS_lstat, (long)path, (long)st, 0, 0, 0, 0) != 0)
            continue; /* as in Python: a path that is not there holds no rule */
        if (st[0] != want[0] || st[1] != want[1])
            return 1;
    }
    return 0;
}

/* The ruleset judge.c built is no longer the one in use (a written folder was replaced:
 * Python built it again and checks its own inodes): stockade_spawn stops checking these. */
__attribute__((visibility("default"))) void stockade_forget_setup(void) { setup_inodes_len = 0; }

/* What Rules.confine does, in one call from the forked shim (in Python, each call and each
 * stat there touches objects the fork shares, and every page touched is copied: about
 * 0.2 ms): dumpable (so the judge can read the code's memory), then the Landlock domain.
 * ``inodes``: for each written path, its device and inode when the ruleset was built (two
 * u64), then the path, NUL-ended. A path that now leads elsewhere (the folder was replaced:
 * the ruleset's rule holds the old one) returns 1 before anything is done, and the caller
 * does it all in Python, rebuilding the ruleset. 0: done; -errno: failed. ``subreaper``: a
 * shim's, which then also becomes a child subreaper here, so that it makes one call into C
 * instead of two (the first call of each kind in a fork costs ~45 us of copied pages). */
__attribute__((visibility("default"))) int stockade_confine(int dumpable, int ruleset, const char *inodes,
                                                            int len, int subreaper)
{
    if (replaced(inodes, len))
        return 1;
    long r;
    if (dumpable && (r = sc(SYS_prctl, PR_SET_DUMPABLE, 1, 0, 0, 0, 0)) != 0)
        return (int)r;
    if (ruleset >= 0 && (r = sc(SYS_landlock_restrict_self, ruleset, 0, 0, 0, 0, 0)) != 0)
        return (int)r;
    if (subreaper && (r = sc(SYS_prctl, PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0, 0)) != 0)
        return (int)r;
    return 0;
}

/* -- starting a command's shim, from the supervisor ---------------------------------------- */

/* What reaper.spawn_program does with posix_spawn, for a sandbox whose execs the judge stops:
 * a posix_spawn's child would wait in the kernel at its exec of the shim, for a judge that
 * cannot tell it from code's. Here the child is ours (vfork: our memory, our parent thread
 * waiting) and writes its pid where the judge's thread looks (``spawning``) before it execs.
 * The command the shim then starts is judged as any exec is. */

#define SPAWN_FLAGS (0x100 | 0x4000 | 17) /* CLONE_VM | CLONE_VFORK, SIGCHLD at its end */
#define F_SETFD 2
#define ESTALE 116

struct spawn {
    const char *path; /* the shim: /proc/self/fd/N */
    char **argv, **envp;
    int fds[3];      /* its 0, 1 and 2 (each above 2) */
    int ruleset;     /* kept open across the exec (the shim enters it), or -1 */
    u32 defaults;    /* the signals to set to their default (bit N-1: signal N, up to 32) */
    volatile long error;
};

static struct spawn *sp;

__attribute__((visibility("hidden"), used, noinline, noreturn)) void stockade_spawn_child(void)
{
    struct spawn *a = sp;
    spawning = sc(SYS_getpid, 0, 0, 0, 0, 0, 0);
    long r = sc(SYS_setsid, 0, 0, 0, 0, 0, 0);
    /* Every signal stays blocked here (no handler of the parent's runs in its memory; the
     * shim unblocks them). The ignored ones would stay ignored across the exec: default. */
    u64 dfl[4] = {0, 0, 0, 0}; /* struct k_sigaction: SIG_DFL, no flags, no restorer, empty mask */
    for (long sig = 1; sig <= 32 && r >= 0; sig++)
        if (a->defaults >> (sig - 1) & 1)
            sc(SYS_rt_sigaction, sig, (long)dfl, 0, 8, 0, 0);
    for (int i = 0; i < 3 && r >= 0; i++)
        r = sc(SYS_dup2, a->fds[i], i, 0, 0, 0, 0);
    if (r >= 0 && a->ruleset >= 0)
        r = sc(SYS_fcntl, a->ruleset, F_SETFD, 0, 0, 0, 0);
    if (r >= 0 && keyed) /* the filter lets it through: no judge woken for it */
        r = sc(SYS_execve, (long)a->path, (long)a->argv, (long)a->envp, (long)exec_key()[0], (long)exec_key()[1], 0);
    else if (r >= 0)
        r = sc(SYS_execve, (long)a->path, (long)a->argv, (long)a->envp, 0, 0, 0);
    a->error = r;
    for (;;)
        sc(SYS_exit, 127, 0, 0, 0, 0, 0);
}

/* Start the shim: ``words`` holds its path, then ``argc`` arguments, then ``envc``
 * environment entries, each NUL-ended; ``in``/``out``/``err`` become its 0, 1 and 2;
 * ``ruleset`` (or -1) stays open for it; the signals in ``defaults`` (the ones we ignore)
 * are set to their default, and all are left blocked for the shim to unblock. Returns its pid; -ESTALE if a written folder was
 * replaced since the ruleset was built (nothing started: the caller's Python shim rebuilds
 * it); else -errno (nothing started, nothing left to reap). */
__attribute__((visibility("default"))) int stockade_spawn(const char *words, int len, int argc, int envc,
                                                          int in, int out, int err, int ruleset,
                                                          unsigned int defaults)
{
    if (ruleset >= 0 && replaced(0, 0))
        return -ESTALE;
    if (len <= 0 || words[len - 1] != 0 || argc < 1 || envc < 0 || in < 3 || out < 3 || err < 3)
        return -EINVAL;
    long mapped = map_spawn_area();
    if (mapped < 0)
        return (int)mapped;
    unsigned long table = (unsigned long)(argc + envc + 2) * 8;
    long pointers = sc(SYS_mmap, 0, (long)table, 3, 0x22, -1, 0);
    if (pointers < 0 && pointers > -4096)
        return (int)pointers;
    char **slots = (char **)pointers;
    const char *at = words, *end = words + len;
    struct spawn a;
    a.path = at;
    at += slen(at) + 1;
    int n = 0;
    for (; at < end && n < argc + envc; n++) {
        slots[n + (n >= argc)] = (char *)at; /* a NULL between the two lists */
        at += slen(at) + 1;
    }
    if (n != argc + envc || at != end) {
        sc(SYS_munmap, pointers, (long)table, 0, 0, 0, 0);
        return -EINVAL;
    }
    slots[argc] = 0;
    slots[argc + envc + 1] = 0;
    a.argv = slots;
    a.envp = slots + argc + 1;
    a.fds[0] = in;
    a.fds[1] = out;
    a.fds[2] = err;
    a.ruleset = ruleset;
    a.defaults = defaults;
    a.error = 0;
    sp = &a;
    u64 all = ~0UL, old = 0;
    sc(SYS_rt_sigprocmask, 0 /* SIG_BLOCK */, (long)&all, (long)&old, 8, 0, 0);
    long pid = clone_into(SPAWN_FLAGS, (void *)(spawn_area + SPAWN_STACK), stockade_spawn_child);
    spawning = 0;
    sc(SYS_rt_sigprocmask, 2 /* SIG_SETMASK */, (long)&old, 0, 8, 0, 0);
    sc(SYS_munmap, pointers, (long)table, 0, 0, 0, 0);
    if (pid > 0 && a.error < 0) { /* it could not exec: it has ended, reaped here */
        int status;
        sc(SYS_wait4, pid, (long)&status, 0, 0, 0, 0);
        return (int)a.error;
    }
    return (int)pid;
}
