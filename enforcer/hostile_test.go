package enforcer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/internal/config"
)

// Roles of the hostile-caller tests (MGPU_HOSTILE_ROLE), dispatched before
// TestMain.
const (
	envHostileRole = "MGPU_HOSTILE_ROLE"
	roleReuseNS    = "reuse-ns"       // pid 1 of a new pid namespace: runs the pid reuse scenario
	roleReuseAtk   = "reuse-attacker" // connects, hands the connection to a holder, exits
	roleReuseHold  = "reuse-holder"   // sends the request on the inherited connection when told
)

func init() {
	switch os.Getenv(envHostileRole) {
	case "":
		return
	case roleReuseNS:
		os.Exit(reuseScenario())
	case roleReuseAtk:
		os.Exit(reuseAttacker())
	case roleReuseHold:
		os.Exit(reuseHolder())
	}
	fmt.Fprintf(os.Stderr, "unknown %s\n", envHostileRole)
	os.Exit(2)
}

// TestAttachHostileClients: silent, slow, oversized, malformed clients and
// clients that send many descriptors, all at once from one instance (the
// flood of 1,024 silent connections is test/tenants' TestAttachFlood); a
// neighbour attaches within 1 s meanwhile, and afterwards the flooding
// instance is served again and no descriptor is left behind.
func TestAttachHostileClients(t *testing.T) {
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	if _, err := c.Create(ctx, tree(os.Getpid(), 40, 2048)); err != nil {
		t.Fatal(err)
	}
	sock := api.ClientSocket(env.runDir())
	h := startHelper(t, sock, nil)
	if _, err := c.Create(ctx, tree(h.cmd.Process.Pid, 40, 2048)); err != nil {
		t.Fatal(err)
	}
	before := openFDs(t)
	done := make(chan struct{})
	var wg sync.WaitGroup
	valid := attach.NewRequest().Marshal()
	clients := map[string]func(net.Conn){
		"silent": func(net.Conn) {},
		"slow": func(c net.Conn) {
			for _, b := range valid[:8] {
				if _, err := c.Write([]byte{b}); err != nil {
					return
				}
				time.Sleep(30 * time.Millisecond) // the client's pace
			}
		},
		"oversized": func(c net.Conn) { _, _ = c.Write(make([]byte, 1<<20)) },
		"malformed": func(c net.Conn) { _, _ = c.Write([]byte("GET / HTTP/1.0\r\n\r\n")) },
		"descriptors": func(c net.Conn) {
			fds := make([]int, 200)
			for i := range fds {
				fds[i] = int(os.Stdin.Fd())
			}
			_, _, _ = c.(*net.UnixConn).WriteMsgUnix(valid[:], unix.UnixRights(fds...), nil)
		},
		"wrong pidfd": func(c net.Conn) {
			pfd, err := unix.PidfdOpen(h.cmd.Process.Pid, 0) // the neighbour's
			if err != nil {
				return
			}
			defer unix.Close(pfd)
			_, _, _ = c.(*net.UnixConn).WriteMsgUnix(valid[:], unix.UnixRights(pfd), nil)
		},
	}
	for name, act := range clients {
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-done:
						return
					default:
					}
					conn, err := net.Dial("unix", sock)
					if err != nil {
						time.Sleep(time.Millisecond) // backlog full: the client's pace
						continue
					}
					act(conn)
					_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
					_, _ = io.Copy(io.Discard, conn)
					_ = conn.Close()
				}
			}()
		}
		_ = name
	}
	time.Sleep(200 * time.Millisecond) // let the hostile clients get going (load, not synchronisation)
	t0 := time.Now()
	line := h.attach(t)
	took := time.Since(t0)
	t.Logf("neighbour attached beside hostile clients in %v: %s", took, line)
	if !strings.HasPrefix(line, "ok ") || took > time.Second {
		t.Fatalf("neighbour beside hostile clients: %q after %v, want ok within 1s", line, took)
	}
	close(done)
	wg.Wait()
	eventually(t, 5*time.Second, "the hostile instance attaches again", func() bool {
		res, err := attach.Dial(sock, time.Second)
		if err == nil {
			res.Close()
		}
		return err == nil
	})
	eventually(t, 5*time.Second, "no socket or pidfd left behind", func() bool {
		return openFDs(t) <= before+4 // the key cache's pidfds of the two callers, and the slot watch of the last attach
	})
}

// openFDs counts the test process's sockets and pidfds (what an attach
// connection holds in the enforcer); regions' memfds come and go with the
// blank region the enforcer keeps ready.
func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		l, _ := os.Readlink("/proc/self/fd/" + e.Name())
		if strings.HasPrefix(l, "socket:") || strings.Contains(l, "pidfd") {
			n++
		}
	}
	return n
}

// TestSharedPidNamespaceRefused: a second container whose init is in the
// pid namespace an instance's container holds (Kubernetes
// shareProcessNamespace, docker --pid container:X) is refused with one
// line, never merged into the first.
func TestSharedPidNamespaceRefused(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root for a new pid namespace")
	}
	env := newEnv(t, nil)
	env.start(t)
	c := env.client()
	// A shell as pid 1 of a new namespace with a second process in it.
	sh := exec.Command("sh", "-c", "sleep 300 & echo started; wait")
	sh.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	out, err := sh.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.Start(); err != nil {
		t.Skipf("cannot start a shell in a new pid namespace: %v", err)
	}
	t.Cleanup(func() { _ = sh.Process.Kill(); _ = sh.Wait() })
	if _, err := bufio.NewReader(out).ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	kids, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", sh.Process.Pid, sh.Process.Pid))
	if err != nil || len(strings.Fields(string(kids))) != 1 {
		t.Fatalf("children of the namespace's init: %q %v", kids, err)
	}
	second, _ := strconv.Atoi(strings.Fields(string(kids))[0])
	first, err := c.Create(ctx, api.CreateRequest{ContainerID: "app", PID: sh.Process.Pid, Core: 10, MemoryMiB: 1})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Create(ctx, api.CreateRequest{ContainerID: "sidecar", PID: second, Core: 10, MemoryMiB: 1})
	want := "container sidecar shares its pid namespace with container app (instance " + first.Instance.Name + ")"
	if err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "\n") {
		t.Fatalf("second container in a shared pid namespace: %v\nwant one line with %q", err, want)
	}
	if l, _ := c.List(ctx); len(l) != 1 {
		t.Fatalf("instances %+v, want only the first", l)
	}
}

// TestSentPidfd: on Linux < 6.5 the caller's pidfd is the one it sends,
// taken only when it is a pidfd of the process that holds the connection.
func TestSentPidfd(t *testing.T) {
	dir, err := os.MkdirTemp("", "mgpu")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: dir + "/s", Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	other := startSleeper(t, nil)
	otherFD, err := unix.PidfdOpen(other.Process.Pid, 0)
	if err != nil {
		t.Skipf("pidfd_open: %v", err)
	}
	defer unix.Close(otherFD)
	own, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(own)
	r, w, _ := os.Pipe()
	defer r.Close()
	defer w.Close()
	// Each case: what the client sends, on a connection of the test's own.
	for _, tc := range []struct {
		name   string
		sent   func(client int) ([]int, int)
		errHas string
	}{
		{"own pidfd and socket", func(cl int) ([]int, int) { return []int{own}, cl }, ""},
		{"nothing", func(cl int) ([]int, int) { return nil, cl }, "sent 0 descriptors"},
		{"no socket number", func(int) ([]int, int) { return []int{own}, -1 }, "no descriptor number"},
		{"two", func(cl int) ([]int, int) { return []int{own, own}, cl }, "sent 2 descriptors"},
		{"a pipe", func(cl int) ([]int, int) { return []int{int(r.Fd())}, cl }, "not a pidfd"},
		{"another process's pidfd", func(cl int) ([]int, int) { return []int{otherFD}, cl }, "is of pid"},
		{"another descriptor of the caller", func(int) ([]int, int) { return []int{own}, int(w.Fd()) }, "not the process that connected"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, err := net.DialUnix("unix", nil, ln.Addr().(*net.UnixAddr))
			if err != nil {
				t.Fatal(err)
			}
			defer client.Close()
			conn, err := ln.AcceptUnix()
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			cf, _ := client.File() // a descriptor of the client's end the test knows
			defer cf.Close()
			sent, n := tc.sent(int(cf.Fd()))
			dup := make([]int, len(sent))
			for i, fd := range sent {
				dup[i], _ = unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
			}
			defer closeFDs(dup)
			req := attach.NewRequest()
			req.SockFD = uint32(n + 1)
			fd, err := sentPidfd(conn, dup, os.Getpid(), uint32(os.Geteuid()), req)
			if fd >= 0 {
				unix.Close(fd)
			}
			if tc.errHas == "" && err != nil || tc.errHas != "" && (err == nil || !strings.Contains(err.Error(), tc.errHas)) {
				t.Fatalf("err %v, want %q", err, tc.errHas)
			}
		})
	}
}

// TestPidReuseGetsNoRegion forces the pid of a caller that connected and
// exited onto a process of another instance (a new pid namespace,
// ns_last_pid) while the connection lives on in a child; the child then
// sends the request with the best pidfd it can make, the reused pid's. It
// must be refused, whether the kernel gives the enforcer the caller's pidfd
// (SO_PEERPIDFD) or not (Linux < 6.5, emulated with a seccomp filter that
// fails that getsockopt).
func TestPidReuseGetsNoRegion(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root for a pid namespace and ns_last_pid")
	}
	for _, old := range []bool{false, true} {
		name := "SO_PEERPIDFD"
		if old {
			name = "Linux before 6.5"
		}
		t.Run(name, func(t *testing.T) {
			// The scenario cannot always put the pid on the victim: a
			// thread the Go runtime starts in the namespace meanwhile
			// may take it for good. Then it runs again, in a new
			// namespace.
			var out []byte
			res := map[string]string{}
			for try := 0; try < 5 && res["reused"] != "true"; try++ {
				env := newEnv(t, nil)
				cmd := exec.Command(os.Args[0], "-test.run=^$")
				cmd.Env = append(os.Environ(), envHostileRole+"="+roleReuseNS, "MGPU_TEST_CONFIG="+env.cfgPath, "MGPU_TEST_OLD_KERNEL="+strconv.FormatBool(old))
				cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS}
				cmd.Stderr = os.Stderr
				var err error
				out, err = cmd.Output()
				t.Logf("try %d: %s", try, out)
				if err != nil {
					t.Fatalf("scenario: %v", err)
				}
				for _, f := range strings.Fields(string(out)) {
					if k, v, ok := strings.Cut(f, "="); ok {
						res[k] = v
					}
				}
			}
			if res["reused"] != "true" {
				t.Fatalf("the victim did not get the exited caller's pid: %s", out)
			}
			if res["holder"] != "refused" || res["victim_processes"] != "0" {
				t.Fatalf("a connection of an exited caller whose pid was reused got: %s", out)
			}
		})
	}
}

// reuseScenario is pid 1 of a new pid and mount namespace.
func reuseScenario() int {
	fail := func(f string, a ...any) int { fmt.Fprintf(os.Stderr, "reuse: "+f+"\n", a...); return 1 }
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fail("make / private: %v", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", 0, ""); err != nil {
		return fail("mount proc: %v", err)
	}
	if os.Getenv("MGPU_TEST_OLD_KERNEL") == "true" {
		if err := denyPeerPidfd(); err != nil {
			return fail("seccomp: %v", err)
		}
	}
	cfg, err := config.Load(os.Getenv("MGPU_TEST_CONFIG"))
	if err != nil {
		return fail("%v", err)
	}
	e, err := New(cfg, 0)
	if err != nil {
		return fail("%v", err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = e.Run(rctx) }()
	c := api.NewClient(api.ControlSocket(cfg.DeviceRunDir(0)))
	sock := api.ClientSocket(cfg.DeviceRunDir(0))
	for start := time.Now(); ; time.Sleep(time.Millisecond) { // poll for the socket
		if _, err := c.List(context.Background()); err == nil {
			break
		}
		if time.Since(start) > 10*time.Second {
			return fail("enforcer not up")
		}
	}
	atk := exec.Command(os.Args[0], "-test.run=^$")
	atk.Env = append(os.Environ(), envHostileRole+"="+roleReuseAtk, "MGPU_TEST_SOCKET="+sock)
	in, _ := atk.StdinPipe()
	outp, _ := atk.StdoutPipe()
	atk.Stderr = os.Stderr
	if err := atk.Start(); err != nil {
		return fail("%v", err)
	}
	if _, err := c.Create(context.Background(), tree(atk.Process.Pid, 10, 1)); err != nil {
		return fail("attacker's instance: %v", err)
	}
	out := bufio.NewReader(outp)
	_, _ = io.WriteString(in, "go\n")
	line, err := out.ReadString('\n')
	if err != nil {
		return fail("attacker: %v", err)
	}
	_, _ = atk.Process.Wait() // not atk.Wait, which would close the pipe the holder writes to
	p := atk.Process.Pid
	// The attacker has exited; its connection lives on in the holder. Put
	// its pid on a process of another instance.
	var victim *exec.Cmd
	for range 50 {
		if err := os.WriteFile("/proc/sys/kernel/ns_last_pid", []byte(strconv.Itoa(p-1)), 0o600); err != nil {
			return fail("ns_last_pid: %v", err)
		}
		v := exec.Command("sleep", "300")
		if err := v.Start(); err != nil {
			return fail("%v", err)
		}
		if v.Process.Pid == p {
			victim = v
			break
		}
		_ = v.Process.Kill()
		_ = v.Wait()
	}
	if victim == nil {
		fmt.Printf("reused=false\n")
		return 0
	}
	defer func() { _ = victim.Process.Kill() }()
	vin, err := c.Create(context.Background(), tree(victim.Process.Pid, 10, 1))
	if err != nil {
		return fail("victim's instance: %v", err)
	}
	_, _ = io.WriteString(in, "go\n") // the holder reads the attacker's stdin
	hl, err := out.ReadString('\n')
	if err != nil {
		return fail("holder: %v", err)
	}
	got, err := c.Get(context.Background(), vin.Instance.Name)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Printf("reused=true %s %s victim_processes=%d\n", strings.TrimSpace(line), strings.TrimSpace(hl), got.Processes)
	return 0
}

// reuseAttacker connects, starts a holder that inherits the connection, and
// exits.
func reuseAttacker() int {
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return 1
	}
	// Silent connections first, as a flood would: the instance's budget
	// is busy with them, so the last one waits its turn (about 1 s)
	// while its caller exits and its pid is reused.
	var files []*os.File
	for range 8 + 1 {
		conn, err := net.Dial("unix", os.Getenv("MGPU_TEST_SOCKET"))
		if err != nil {
			return 1
		}
		f, err := conn.(*net.UnixConn).File()
		if err != nil {
			return 1
		}
		files = append(files, f)
	}
	h := exec.Command(os.Args[0], "-test.run=^$")
	h.Env = append(os.Environ(), envHostileRole+"="+roleReuseHold, "MGPU_TEST_PID="+strconv.Itoa(os.Getpid()))
	h.Stdin, h.Stdout, h.Stderr = os.Stdin, os.Stdout, os.Stderr
	h.ExtraFiles = append([]*os.File{files[len(files)-1]}, files[:len(files)-1]...) // the last one is descriptor 3
	if err := h.Start(); err != nil {
		return 1
	}
	fmt.Printf("attacker=%d\n", os.Getpid())
	return 0
}

// reuseHolder waits for a line, then sends the request on descriptor 3
// with a pidfd of the attacker's pid (now another process's) and reports.
func reuseHolder() int {
	if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
		return 1
	}
	pid, _ := strconv.Atoi(os.Getenv("MGPU_TEST_PID"))
	req := attach.NewRequest()
	req.SockFD = 3 + 1
	b := req.Marshal()
	var oob []byte
	if pfd, err := unix.PidfdOpen(pid, 0); err == nil {
		oob = unix.UnixRights(pfd)
	}
	if err := unix.Sendmsg(3, b[:], oob, nil, 0); err != nil {
		fmt.Printf("holder=send-failed\n")
		return 0
	}
	buf := make([]byte, attach.ResponseSize)
	rb := make([]byte, unix.CmsgSpace(16))
	n, oobn, _, _, err := unix.Recvmsg(3, buf, rb, 0)
	if err != nil || n < 8 {
		fmt.Printf("holder=closed\n")
		return 0
	}
	resp, err := attach.DecodeResponse(buf)
	if err == nil && resp.Status == attach.OK {
		fmt.Printf("holder=ok instance=%d fds=%d\n", resp.InstanceID, len(parseRights(rb[:oobn])))
		return 0
	}
	fmt.Printf("holder=refused message=%q\n", strings.ReplaceAll(resp.Message, " ", "_"))
	return 0
}

// denyPeerPidfd makes getsockopt(SO_PEERPIDFD) fail with ENOPROTOOPT in
// this process and its children, as on Linux < 6.5.
func denyPeerPidfd() error {
	var arch uint32
	switch runtime.GOARCH {
	case "amd64":
		arch = unix.AUDIT_ARCH_X86_64
	case "arm64":
		arch = unix.AUDIT_ARCH_AARCH64
	default:
		return errors.New("no seccomp arch for " + runtime.GOARCH)
	}
	const (
		ld    = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
		jeq   = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
		ret   = unix.BPF_RET | unix.BPF_K
		allow = 0x7fff0000 // SECCOMP_RET_ALLOW
		errno = 0x00050000 // SECCOMP_RET_ERRNO
	)
	prog := []unix.SockFilter{
		{Code: ld, K: 4}, // arch
		{Code: jeq, K: arch, Jf: 5},
		{Code: ld, K: 0}, // nr
		{Code: jeq, K: unix.SYS_GETSOCKOPT, Jf: 3},
		{Code: ld, K: 16 + 8*2}, // args[2], the option (low half)
		{Code: jeq, K: unix.SO_PEERPIDFD, Jf: 1},
		{Code: ret, K: errno | uint32(unix.ENOPROTOOPT)},
		{Code: ret, K: allow},
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return err
	}
	const setModeFilter, flagTsync = 1, 1
	if _, _, e := unix.Syscall(unix.SYS_SECCOMP, setModeFilter, flagTsync, uintptr(unsafe.Pointer(&fprog))); e != 0 {
		return e
	}
	return nil
}
