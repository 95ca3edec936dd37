/* The egress relay's shortcut on gVisor: a library preloaded into the sandbox's programs
 * (LD_PRELOAD) that turns a stream connect to the relay's port (127.0.0.1:3128, where
 * HTTP_PROXY points) into a connect to the proxy's socket bound into the sandbox. The code's
 * connection then skips a TCP connection over gVisor's netstack and the relay's hop (about
 * 1.5 ms a request there: docs/benchmarks.md). It opens nothing: the socket is the one the
 * relay connects to, which the code can reach itself, and the proxy decides every request as
 * before. When it cannot (the proxy's backlog is full, the call was interrupted, a program
 * without the C library's connect: Go's, static ones), the connect goes to the relay.
 *
 * The descriptor the program holds becomes a Unix socket (dup3 over it, its O_NONBLOCK and
 * FD_CLOEXEC kept). What a program could tell: TCP options are accepted and ignored
 * (setsockopt, and getsockopt reads zeros), getpeername says 127.0.0.1:3128 and getsockname
 * 127.0.0.1 port 0; socket options set before the connect (buffer sizes, timeouts) are not
 * carried over. A socket already connecting to the relay (a connect the shortcut could not
 * make, asked again by a program checking on it) is replaced the same way: it is then
 * connected, to the proxy.
 *
 * Freestanding, like judge.c: no libc (system calls inline), errno through the C library's
 * __errno_location (glibc's and musl's), so one build loads into any image's programs.
 * x86_64 only. PROXY_PORT and PROXY_SOCKET come from the build (stockade/egress/_preload.py).
 */

typedef unsigned int socklen_t;

struct sockaddr {
    unsigned short sa_family;
    char sa_data[14];
};
struct sockaddr_in {
    unsigned short sin_family;
    unsigned short sin_port; /* network order */
    unsigned int sin_addr;   /* network order */
    unsigned char sin_zero[8];
};
struct sockaddr_un {
    unsigned short sun_family;
    char sun_path[108];
};

extern int *__errno_location(void);

#define SYS_close 3
#define SYS_socket 41
#define SYS_connect 42
#define SYS_getsockname 51
#define SYS_getpeername 52
#define SYS_setsockopt 54
#define SYS_getsockopt 55
#define SYS_fcntl 72
#define SYS_dup3 292

#define AF_UNIX 1
#define AF_INET 2
#define SOCK_STREAM 1
#define SOL_SOCKET 1
#define SO_TYPE 3
#define SO_DOMAIN 39
#define IPPROTO_TCP 6
#define F_GETFD 1
#define F_GETFL 3
#define FD_CLOEXEC 1
#define O_NONBLOCK 04000
#define O_CLOEXEC 02000000
#define ENOPROTOOPT 92
#define EOPNOTSUPP 95

#define LOOPBACK 0x0100007fu /* 127.0.0.1 in network order, on a little-endian CPU */
#define PORT_BE ((unsigned short)((((PROXY_PORT) & 0xff) << 8) | ((PROXY_PORT) >> 8)))

static long sys(long n, long a, long b, long c, long d, long e) {
    long r;
    register long r10 __asm__("r10") = d;
    register long r8 __asm__("r8") = e;
    __asm__ volatile("syscall"
                     : "=a"(r)
                     : "a"(n), "D"(a), "S"(b), "d"(c), "r"(r10), "r"(r8)
                     : "rcx", "r11", "memory");
    return r;
}

static int result(long r) {
    if (r < 0 && r > -4096) {
        *__errno_location() = (int)-r;
        return -1;
    }
    return (int)r;
}

static const struct sockaddr_un proxy = {AF_UNIX, PROXY_SOCKET};
#define PROXY_LEN ((socklen_t)(sizeof(unsigned short) + sizeof(PROXY_SOCKET)))

static int is_relay(const struct sockaddr *addr, socklen_t len) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
    return addr && len >= sizeof(*in) && in->sin_family == AF_INET && in->sin_port == PORT_BE &&
           in->sin_addr == LOOPBACK;
}

/* The proxy's socket in place of fd, or -1 (fd untouched: the connect goes to the relay). */
static int to_proxy(int fd) {
    int type = 0, domain = 0;
    socklen_t len = sizeof(int);
    if (sys(SYS_getsockopt, fd, SOL_SOCKET, SO_TYPE, (long)&type, (long)&len) != 0 || type != SOCK_STREAM)
        return -1;
    len = sizeof(int);
    if (sys(SYS_getsockopt, fd, SOL_SOCKET, SO_DOMAIN, (long)&domain, (long)&len) != 0 || domain != AF_INET)
        return -1;
    long fl = sys(SYS_fcntl, fd, F_GETFL, 0, 0, 0);
    long fdfl = sys(SYS_fcntl, fd, F_GETFD, 0, 0, 0);
    if (fl < 0 || fdfl < 0)
        return -1;
    long u = sys(SYS_socket, AF_UNIX, SOCK_STREAM | O_CLOEXEC | (fl & O_NONBLOCK), 0, 0, 0);
    if (u < 0)
        return -1;
    /* Non-blocking, a connect to a Unix socket is done at once or fails (EAGAIN: the
     * backlog is full): never half-way. */
    long r = sys(SYS_connect, u, (long)&proxy, PROXY_LEN, 0, 0);
    if (r == 0)
        r = sys(SYS_dup3, u, fd, (fdfl & FD_CLOEXEC) ? O_CLOEXEC : 0, 0, 0);
    sys(SYS_close, u, 0, 0, 0, 0);
    return r < 0 ? -1 : 0;
}

__attribute__((visibility("default"))) int connect(int fd, const struct sockaddr *addr, socklen_t len) {
    if (is_relay(addr, len) && to_proxy(fd) == 0)
        return 0;
    return result(sys(SYS_connect, fd, (long)addr, len, 0, 0));
}

/* Whether a peer's address is the proxy's socket. */
static int is_proxy(const struct sockaddr_un *peer, socklen_t len) {
    if (len != PROXY_LEN || peer->sun_family != AF_UNIX)
        return 0;
    for (unsigned i = 0; i < sizeof(PROXY_SOCKET); i++)
        if (peer->sun_path[i] != proxy.sun_path[i])
            return 0;
    return 1;
}

/* Whether fd is connected to the proxy's socket (a descriptor this library connected). */
static int at_proxy(int fd) {
    struct sockaddr_un peer;
    socklen_t len = sizeof(peer);
    return sys(SYS_getpeername, fd, (long)&peer, (long)&len, 0, 0) == 0 && is_proxy(&peer, len);
}

static int unsupported(long r) { return r == -EOPNOTSUPP || r == -ENOPROTOOPT; }

__attribute__((visibility("default"))) int setsockopt(int fd, int level, int name, const void *value,
                                                      socklen_t len) {
    long r = sys(SYS_setsockopt, fd, level, name, (long)value, len);
    if (unsupported(r) && level == IPPROTO_TCP && at_proxy(fd))
        return 0; /* TCP_NODELAY and the like: a Unix socket has no Nagle to turn off */
    return result(r);
}

__attribute__((visibility("default"))) int getsockopt(int fd, int level, int name, void *value, socklen_t *len) {
    long r = sys(SYS_getsockopt, fd, level, name, (long)value, (long)len);
    if (unsupported(r) && level == IPPROTO_TCP && value && len && at_proxy(fd)) {
        for (socklen_t i = 0; i < *len; i++)
            ((char *)value)[i] = 0;
        return 0;
    }
    return result(r);
}

/* Copy an address out as the kernel does: at most the caller's room, the full length told. */
static void give(struct sockaddr *addr, socklen_t *len, const void *from, socklen_t size) {
    for (socklen_t i = 0; i < size && i < *len; i++)
        ((char *)addr)[i] = ((const char *)from)[i];
    *len = size;
}

/* The address a program believes its socket has, in place of the Unix socket's. */
static int as_relay(struct sockaddr *addr, socklen_t *len, unsigned short port) {
    struct sockaddr_in in = {AF_INET, port, LOOPBACK, {0}};
    give(addr, len, &in, sizeof(in));
    return 0;
}

__attribute__((visibility("default"))) int getpeername(int fd, struct sockaddr *addr, socklen_t *len) {
    union {
        struct sockaddr_un un;
        char any[128]; /* sockaddr_storage's size: room for any family's address */
    } peer;
    socklen_t size = sizeof(peer);
    if (!addr || !len)
        return result(sys(SYS_getpeername, fd, (long)addr, (long)len, 0, 0));
    long r = sys(SYS_getpeername, fd, (long)&peer, (long)&size, 0, 0);
    if (r != 0)
        return result(r);
    if (is_proxy(&peer.un, size))
        return as_relay(addr, len, PORT_BE);
    give(addr, len, &peer, size < sizeof(peer) ? size : sizeof(peer));
    *len = size; /* the whole address's length, as the kernel tells it */
    return 0;
}

__attribute__((visibility("default"))) int getsockname(int fd, struct sockaddr *addr, socklen_t *len) {
    socklen_t room = len ? *len : 0;
    long r = sys(SYS_getsockname, fd, (long)addr, (long)len, 0, 0);
    /* An unnamed Unix socket (its address is its family alone) may be one of ours. */
    if (r == 0 && addr && *len == sizeof(unsigned short) && room >= sizeof(unsigned short) &&
        addr->sa_family == AF_UNIX && at_proxy(fd)) {
        *len = room;
        return as_relay(addr, len, 0);
    }
    return result(r);
}
