package main

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/attach"
)

// The attach floor: what any attach of this shape costs on the machine, so
// that the attach figures can be read against it. A preloaded library whose
// constructor makes one request of the attach protocol's size over a unix
// socket (with a descriptor, as the shim sends its pidfd) and waits for a
// reply of the response's size carrying two descriptors, from a server in
// this process that answers at once: one preloaded library, one connection,
// three wake-ups, and nothing mgpu does.
const floorSource = `#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

__attribute__((constructor)) static void floor_attach(void)
{
    const char *p = getenv("MGPU_BENCH_FLOOR_SOCK");
    if (!p)
        return;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(p) >= sizeof sa.sun_path)
        _exit(97);
    strcpy(sa.sun_path, p);
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof sa))
        _exit(98);
    char req[REQ] = {0};
    int fd = (int)syscall(SYS_pidfd_open, (long)getpid(), 0L);
    union {
        char buf[CMSG_SPACE(2 * sizeof(int))];
        struct cmsghdr align;
    } cb;
    memset(&cb, 0, sizeof cb);
    struct iovec iov = {req, sizeof req};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb.buf, .msg_controllen = CMSG_SPACE(sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (fd < 0)
        mh.msg_control = NULL, mh.msg_controllen = 0;
    if (sendmsg(s, &mh, MSG_NOSIGNAL) != (ssize_t)sizeof req)
        _exit(99);
    if (fd >= 0)
        close(fd);
    char resp[RESP];
    iov = (struct iovec){resp, sizeof resp};
    mh = (struct msghdr){.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb.buf, .msg_controllen = sizeof cb.buf};
    if (recvmsg(s, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL) != (ssize_t)sizeof resp)
        _exit(100);
    for (c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int fds[2];
            size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            memcpy(fds, CMSG_DATA(c), n * sizeof(int));
            for (size_t i = 0; i < n && i < 2; i++)
                close(fds[i]);
        }
    close(s);
}
`

// floorServer is the floor's library (built with the C compiler the build
// uses) and the server that answers it.
type floorServer struct {
	dir  string
	lib  string
	sock string
	l    *net.UnixListener
	fds  [2]*os.File
	wg   sync.WaitGroup
}

func startFloor() (*floorServer, error) {
	dir, err := os.MkdirTemp("", "mgpu-bench-floor-")
	if err != nil {
		return nil, err
	}
	f := &floorServer{dir: dir, lib: filepath.Join(dir, "libfloor.so"), sock: filepath.Join(dir, "floor.sock")}
	src := filepath.Join(dir, "floor.c")
	if err := os.WriteFile(src, []byte(floorSource), 0o600); err != nil {
		f.close()
		return nil, err
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if out, err := exec.Command(cc, "-O2", "-shared", "-fPIC", //nolint:gosec // the build's compiler
		fmt.Sprintf("-DREQ=%d", attach.RequestSize), fmt.Sprintf("-DRESP=%d", attach.ResponseSize),
		"-o", f.lib, src).CombinedOutput(); err != nil {
		f.close()
		return nil, fmt.Errorf("building the attach floor's library with %s: %w: %s", cc, err, strings.TrimSpace(string(out)))
	}
	for i := range f.fds {
		if f.fds[i], err = os.Open(os.DevNull); err != nil {
			f.close()
			return nil, err
		}
	}
	if f.l, err = net.ListenUnix("unix", &net.UnixAddr{Name: f.sock, Net: "unix"}); err != nil {
		f.close()
		return nil, err
	}
	f.wg.Add(1)
	go f.serve()
	return f, nil
}

func (f *floorServer) serve() {
	defer f.wg.Done()
	rights := unix.UnixRights(int(f.fds[0].Fd()), int(f.fds[1].Fd()))
	for {
		c, err := f.l.AcceptUnix()
		if err != nil {
			return
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer func() { _ = c.Close() }()
			req := make([]byte, attach.RequestSize)
			oob := make([]byte, unix.CmsgSpace(4))
			n, oobn, _, _, err := c.ReadMsgUnix(req, oob)
			if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
				for _, m := range msgs {
					if fds, rerr := unix.ParseUnixRights(&m); rerr == nil {
						for _, fd := range fds {
							_ = unix.Close(fd)
						}
					}
				}
			}
			if err != nil || n != attach.RequestSize {
				return
			}
			_, _, _ = c.WriteMsgUnix(make([]byte, attach.ResponseSize), rights, nil)
		}()
	}
}

// env is base with the floor's library preloaded and its socket named.
func (f *floorServer) env(base []string) []string {
	var out []string
	for _, e := range base {
		if !strings.HasPrefix(e, "LD_PRELOAD=") {
			out = append(out, e)
		}
	}
	return append(out, "LD_PRELOAD="+f.lib, "MGPU_BENCH_FLOOR_SOCK="+f.sock)
}

func (f *floorServer) close() {
	if f.l != nil {
		_ = f.l.Close()
		f.wg.Wait()
	}
	for _, fd := range f.fds {
		if fd != nil {
			_ = fd.Close()
		}
	}
	if err := os.RemoveAll(f.dir); err != nil && !errors.Is(err, os.ErrNotExist) {
		fmt.Fprintf(os.Stderr, "mgpu-bench: %v\n", err)
	}
}
