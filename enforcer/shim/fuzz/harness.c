/*
 * harness.c - runs the shim's parsers of what it reads from outside
 * (parse_visible, read_resp, check_resp) on inputs, under ASan and UBSan,
 * and answers what they returned (see README.md).
 *
 * The parsers are static in init.c: this translation unit includes it, so
 * that they are tested as the library compiles them, and the harness is
 * linked with the shim's other sources.  Nothing of the shim runs but the
 * parser called.
 */
#include "../src/init.c"

#include <dirent.h>
#include <stdarg.h>
#include <stdint.h>

#define FZ_MAX_INPUT (1u << 20)
#define FZ_MAX_SEGS 64       /* read_resp: writes on the socket */
#define FZ_MAX_SENT_FDS 512  /* read_resp: descriptors sent, all writes together */
#define FZ_SEND_MAX_FDS 253  /* the kernel's limit of descriptors in one message (SCM_MAX_FD) */
#define FZ_MAX_ERRLEN 512

/* A harness error (not the parsers'): the driver reports the line. */
static void die(const char *what)
{
    fprintf(stderr, "mgpu-shim-fuzz: %s: %s\n", what, strerror(errno));
    exit(2);
}

/* A broken promise of a parser: abort, as the sanitizers do. */
static void bug(const char *what)
{
    fprintf(stderr, "mgpu-shim-fuzz: BUG: %s\n", what);
    abort();
}

struct out {
    char *buf;
    size_t len, cap;
};

static void put(struct out *o, const void *p, size_t n)
{
    if (o->len + n > o->cap) {
        size_t cap = o->cap ? o->cap : 1024;
        while (cap < o->len + n)
            cap *= 2;
        char *b = realloc(o->buf, cap);
        if (!b)
            die("realloc");
        o->buf = b;
        o->cap = cap;
    }
    memcpy(o->buf + o->len, p, n);
    o->len += n;
}

static void putf(struct out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void putf(struct out *o, const char *fmt, ...)
{
    char b[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b, sizeof b, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof b)
        bug("putf overflow");
    put(o, b, (size_t)n);
}

static unsigned open_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (!d)
        die("/proc/self/fd");
    unsigned n = 0;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* 'v' + MGPU_VISIBLE_DEVICES (up to the first NUL): "rc n idx...". */
static void run_visible(const unsigned char *in, size_t len, struct out *o)
{
    size_t n = strnlen((const char *)in, len);
    char *v = malloc(n + 1); /* exactly the string: ASan sees a read past it */
    unsigned *idx = malloc(MGPU_MAX_DEVICES * sizeof *idx);
    if (!v || !idx)
        die("malloc");
    memcpy(v, in, n);
    v[n] = 0;
    int cnt = -1;
    int rc = parse_visible(v, idx, &cnt);
    if (rc != 0 && rc != -1)
        bug("parse_visible returned neither 0 nor -1");
    if (cnt < 0 || cnt > (int)MGPU_MAX_DEVICES)
        bug("parse_visible counted outside 0..MGPU_MAX_DEVICES");
    putf(o, "%d %d", rc, cnt);
    for (int i = 0; i < cnt; i++)
        putf(o, " %u", idx[i]);
    free(v);
    free(idx);
}

static size_t err_len(unsigned sel) { return 1 + sel % FZ_MAX_ERRLEN; }

static void check_err(const char *err, size_t errlen, int rc)
{
    if (!memchr(err, 0, errlen))
        bug("err is not terminated within errlen");
    if (rc && errlen > 1 && !err[0])
        bug("failed with an empty err");
}

/* 'c' + errlen (2 bytes, little-endian) + a response (zero-padded):
 * "rc\nerr". */
static void run_check(const unsigned char *in, size_t len, struct out *o)
{
    unsigned sel = (len > 0 ? in[0] : 0) | (len > 1 ? in[1] : 0) << 8;
    size_t errlen = err_len(sel);
    in += len > 2 ? 2 : len;
    len -= len > 2 ? 2 : len;
    mgpu_attach_resp_t *resp = calloc(1, sizeof *resp);
    char *err = malloc(errlen);
    if (!resp || !err)
        die("malloc");
    memcpy(resp, in, len < sizeof *resp ? len : sizeof *resp);
    memset(err, 'x', errlen);
    int rc = check_resp(resp, err, errlen);
    if (rc != 0 && rc != -1)
        bug("check_resp returned neither 0 nor -1");
    putf(o, "%d\n", rc);
    if (rc) {
        check_err(err, errlen, rc);
        put(o, err, strlen(err));
    }
    free(resp);
    free(err);
}

/* 'r' + max + errlen + writes, each a count of descriptors and a length:
 * the writes go on a stream socket pair (with that many descriptors of
 * /dev/null each), the writing end is shut, and read_resp reads the other
 * end.  "rc nfds\n" and the response in hex, or err. */
static void run_read(const unsigned char *in, size_t len, struct out *o, int devnull)
{
    unsigned max = (len > 0 ? in[0] : 0) % (MGPU_REGION_MAX_PROCS + 1);
    size_t errlen = err_len(len > 1 ? in[1] : 0);
    in += len > 2 ? 2 : len;
    len -= len > 2 ? 2 : len;

    unsigned before = open_fds();
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv))
        die("socketpair");
    unsigned segs = 0, sent_fds = 0;
    while (len >= 2 && segs < FZ_MAX_SEGS) {
        unsigned nfd = in[0] < FZ_SEND_MAX_FDS ? in[0] : FZ_SEND_MAX_FDS;
        size_t n = in[1] < len - 2 ? in[1] : len - 2;
        const unsigned char *data = in + 2;
        in += 2 + n;
        len -= 2 + n;
        segs++;
        if (n == 0)
            continue;
        if (sent_fds + nfd > FZ_MAX_SENT_FDS)
            nfd = 0;
        sent_fds += nfd;
        union {
            char buf[CMSG_SPACE(FZ_SEND_MAX_FDS * sizeof(int))];
            struct cmsghdr align;
        } cbuf;
        struct iovec iov = {(void *)data, n};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        if (nfd) {
            mh.msg_control = cbuf.buf;
            mh.msg_controllen = CMSG_SPACE(nfd * sizeof(int));
            struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(nfd * sizeof(int));
            for (unsigned i = 0; i < nfd; i++)
                memcpy(CMSG_DATA(c) + i * sizeof(int), &devnull, sizeof(int));
        }
        ssize_t w = sendmsg(sv[0], &mh, MSG_NOSIGNAL);
        if (w != (ssize_t)n)
            die("sendmsg");
    }
    if (shutdown(sv[0], SHUT_WR))
        die("shutdown");

    mgpu_attach_resp_t *resp = calloc(1, sizeof *resp);
    int *fds = malloc(max ? max * sizeof(int) : 1); /* room for max: ASan sees a write past it */
    char *err = malloc(errlen);
    if (!resp || !fds || !err)
        die("malloc");
    memset(err, 'x', errlen);
    unsigned nfds = 12345;
    int rc = read_resp(sv[1], resp, fds, &nfds, max, err, errlen);
    if (rc != 0 && rc != -1)
        bug("read_resp returned neither 0 nor -1");
    if (rc) {
        check_err(err, errlen, rc);
        if (nfds != 0)
            bug("read_resp failed with descriptors counted");
    } else if (nfds > max) {
        bug("read_resp kept more than max descriptors");
    }
    for (unsigned i = 0; i < (rc ? 0 : nfds); i++) {
        int fl = fcntl(fds[i], F_GETFD);
        if (fl < 0)
            bug("read_resp returned a descriptor that is not open");
        if (!(fl & FD_CLOEXEC))
            bug("read_resp returned a descriptor without FD_CLOEXEC");
        for (unsigned j = 0; j < i; j++)
            if (fds[j] == fds[i])
                bug("read_resp returned a descriptor twice");
    }
    putf(o, "%d %u\n", rc, rc ? 0 : nfds);
    if (rc == 0) {
        for (size_t i = 0; i < sizeof *resp; i++)
            putf(o, "%02x", ((const unsigned char *)resp)[i]);
        for (unsigned i = 0; i < nfds; i++)
            close(fds[i]);
    } else {
        put(o, err, strlen(err));
    }
    close(sv[0]);
    close(sv[1]);
    if (open_fds() != before)
        bug("descriptors left open");
    free(resp);
    free(fds);
    free(err);
}

static void run(const unsigned char *in, size_t len, struct out *o, int devnull)
{
    o->len = 0;
    if (len == 0)
        return;
    switch (in[0]) {
    case 'v':
        run_visible(in + 1, len - 1, o);
        break;
    case 'c':
        run_check(in + 1, len - 1, o);
        break;
    case 'r':
        run_read(in + 1, len - 1, o, devnull);
        break;
    default:
        putf(o, "unknown target %#x", in[0]);
    }
}

static int read_full(int fd, void *p, size_t n)
{
    char *b = p;
    while (n) {
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

static void write_full(int fd, const void *p, size_t n)
{
    const char *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            die("write");
        b += w;
        n -= (size_t)w;
    }
}

static void frame(const struct out *o)
{
    unsigned char h[4] = {(unsigned char)o->len, (unsigned char)(o->len >> 8), (unsigned char)(o->len >> 16),
                          (unsigned char)(o->len >> 24)};
    write_full(1, h, sizeof h);
    write_full(1, o->buf, o->len);
}

int main(int argc, char **argv)
{
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (devnull < 0)
        die("/dev/null");
    struct out o = {0};
    if (argc > 1) { /* each file one input; the answers on stdout */
        for (int i = 1; i < argc; i++) {
            FILE *f = fopen(argv[i], "rb");
            if (!f)
                die(argv[i]);
            unsigned char *in = malloc(FZ_MAX_INPUT);
            if (!in)
                die("malloc");
            size_t n = fread(in, 1, FZ_MAX_INPUT, f);
            fclose(f);
            run(in, n, &o, devnull);
            printf("%s: %.*s\n", argv[i], (int)o.len, o.buf ? o.buf : "");
            free(in);
        }
        free(o.buf);
        return 0;
    }
    /* Inputs on stdin, answers on stdout, each a 4-byte little-endian
     * length and its bytes; first the constants the answers depend on. */
    putf(&o, "mgpu-shim-fuzz resp=%zu max_procs=%u fd_room=%zu magic=%u version=%u message=%zu/%u max_devices=%u",
         sizeof(mgpu_attach_resp_t), MGPU_REGION_MAX_PROCS,
         (CMSG_SPACE(MGPU_REGION_MAX_PROCS * sizeof(int)) - CMSG_LEN(0)) / sizeof(int), MGPU_ATTACH_MAGIC,
         MGPU_ATTACH_VERSION, offsetof(mgpu_attach_resp_t, message), MGPU_ATTACH_MESSAGE_LEN, (unsigned)MGPU_MAX_DEVICES);
    frame(&o);
    for (;;) {
        unsigned char h[4];
        if (read_full(0, h, sizeof h))
            break;
        size_t n = (size_t)h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16 | (size_t)h[3] << 24;
        if (n > FZ_MAX_INPUT) {
            errno = EMSGSIZE;
            die("input");
        }
        unsigned char *in = malloc(n ? n : 1); /* exactly the input */
        if (!in)
            die("malloc");
        if (read_full(0, in, n)) {
            errno = EPIPE;
            die("input");
        }
        run(in, n, &o, devnull);
        frame(&o);
        free(in);
    }
    free(o.buf);
    return 0;
}
