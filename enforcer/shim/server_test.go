package shim_test

import (
	"encoding/binary"
	"errors"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// The attach protocol of mgpu_region.h.
const (
	attachMagic   = 0x4150474d
	attachVersion = 2
	attachReqLen  = 16
	attachRespLen = 256
	attachMsgOff  = 32

	attachFlagPeers = 1
	attachFlagWake  = 2

	attachOK         = 0
	attachNoInstance = 1
	attachNoSlot     = 2
	attachBadRequest = 3
)

// testServer is a test-only stand-in for the enforcer's client socket: one
// device, one instance.  It serves <dir>/gpu<X>/client/client.sock, hands
// every caller the instance's region and a slot of its own, and reaps the
// slots of processes that are gone.
type testServer struct {
	t      *testing.T
	dir    string
	index  uint32
	reg    *region.Region
	view   *region.View
	ln     *net.UnixListener
	refuse atomic.Pointer[string] // non-nil: answer every attach with NO_INSTANCE and this message
	// beforeReply, when set, runs before an attach is answered, with the
	// caller's pid.
	beforeReply atomic.Pointer[func(pid int)]
	conns       atomic.Int64
	mu          sync.Mutex                   // slot assignment
	claims      []string                     // pids that attached, in order; under mu
	taken       [region.MaxProcs / 64]uint64 // taken slots, as published in the region; under mu
	wg          sync.WaitGroup
	wake        [2]int // the wake socket pair: [0] the server's end, [1] the processes'
}

type serverOpt func(*region.Params)

func withQuota(mib uint64) serverOpt { return func(p *region.Params) { p.MemoryLimit = mib << 20 } }
func withMaxQueued(ns uint64) serverOpt {
	return func(p *region.Params) { p.MaxQueuedNs = ns }
}

// newServer starts a server for device index under dir (the run directory).
func newServer(t *testing.T, dir string, index uint32, opts ...serverOpt) *testServer {
	t.Helper()
	p := region.Params{DeviceIndex: index, InstanceID: 1, Policy: region.PolicyFixedShare, Core: 50,
		MemoryLimit: 1024 << 20, PeriodNs: 100e6, MaxQueuedNs: 4e6}
	for _, o := range opts {
		o(&p)
	}
	gdir := filepath.Join(dir, "gpu"+strconv.Itoa(int(index)))
	for _, d := range []string{filepath.Join(gdir, "regions"), filepath.Join(gdir, "client")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	reg, err := region.Create(filepath.Join(gdir, "regions", "mgpu"+strconv.Itoa(int(index))+"inst1"), p)
	if err != nil {
		t.Fatal(err)
	}
	reg.SetGrant(1)
	view, err := region.NewView(filepath.Join(gdir, "regions"))
	if errors.Is(err, unix.EPERM) {
		_ = reg.Close()
		t.Skip("the shim's tests hand out read-only views of the region, which needs root (CAP_SYS_ADMIN)")
	}
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(gdir, "client", "client.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	wake, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	s := &testServer{t: t, dir: dir, index: index, reg: reg, view: view, ln: ln, wake: [2]int{wake[0], wake[1]}}
	s.wg.Add(1)
	go s.serve()
	t.Cleanup(func() {
		_ = ln.Close()
		s.wg.Wait()
		_ = reg.Close()
		_ = view.Close()
		_ = unix.Close(wake[0])
		_ = unix.Close(wake[1])
	})
	return s
}

func (s *testServer) serve() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			return
		}
		s.conns.Add(1)
		s.handle(c)
		_ = c.Close()
	}
}

func (s *testServer) handle(c *net.UnixConn) {
	raw, err := c.SyscallConn()
	if err != nil {
		return
	}
	var cred *unix.Ucred
	_ = raw.Control(func(fd uintptr) {
		cred, err = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) //nolint:gosec // fd fits
	})
	if err != nil {
		return
	}
	req := make([]byte, attachReqLen)
	if _, err := readFull(c, req); err != nil {
		return
	}
	resp := make([]byte, attachRespLen)
	le := binary.LittleEndian
	le.PutUint32(resp[0:], attachMagic)
	le.PutUint32(resp[4:], attachVersion)
	le.PutUint32(resp[20:], s.index)
	le.PutUint32(resp[24:], 1)
	fail := func(status int32, msg string) {
		le.PutUint32(resp[8:], uint32(status)) //nolint:gosec // small constants
		copy(resp[attachMsgOff:attachRespLen-1], msg)
		_, _ = c.Write(resp)
	}
	if le.Uint32(req[0:]) != attachMagic || le.Uint32(req[4:]) != attachVersion || le.Uint32(req[8:]) > attachFlagWake {
		fail(attachBadRequest, "bad request")
		return
	}
	if le.Uint32(req[8:]) == attachFlagWake {
		_, _, _ = c.WriteMsgUnix(resp, unix.UnixRights(s.wake[1]), nil)
		return
	}
	if le.Uint32(req[8:]) == attachFlagPeers {
		s.peers(c, resp, uint32(cred.Pid)) //nolint:gosec // pids are positive
		return
	}
	if m := s.refuse.Load(); m != nil {
		fail(attachNoInstance, *m)
		return
	}
	if f := s.beforeReply.Load(); f != nil {
		(*f)(int(cred.Pid))
	}
	slot := s.claim(uint32(cred.Pid)) //nolint:gosec // pids are positive
	if slot < 0 {
		fail(attachNoSlot, "no free slot")
		return
	}
	fds, err := s.reg.TenantFDs(s.view, slot)
	if err != nil {
		fail(attachBadRequest, err.Error())
		return
	}
	defer func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}()
	le.PutUint32(resp[12:], uint32(slot)) //nolint:gosec // < MaxProcs
	le.PutUint32(resp[16:], region.ControlFileSize)
	le.PutUint32(resp[28:], region.ProcFileSize)
	_, _, _ = c.WriteMsgUnix(resp, unix.UnixRights(fds...), nil)
}

// peers answers a peers request: the read-only proc files of the other
// attached processes, their slots as a bitmap at the message's offset.
func (s *testServer) peers(c *net.UnixConn, resp []byte, pid uint32) {
	s.mu.Lock()
	var slots []int
	own := -1
	for i := 0; i < region.MaxProcs; i++ {
		switch p := s.reg.Proc(i).PID.Load(); {
		case p == pid:
			own = i
		case p != 0:
			slots = append(slots, i)
		}
	}
	var fds []int
	var err error
	if own >= 0 {
		fds, err = s.reg.PeerFDs(s.view, slots) // under mu: claim gives slots their memfds
	}
	s.mu.Unlock()
	le := binary.LittleEndian
	if own < 0 {
		le.PutUint32(resp[8:], attachNoInstance)
		copy(resp[attachMsgOff:attachRespLen-1], "not attached")
		_, _ = c.Write(resp)
		return
	}
	if err != nil {
		le.PutUint32(resp[8:], attachBadRequest)
		copy(resp[attachMsgOff:attachRespLen-1], err.Error())
		_, _ = c.Write(resp)
		return
	}
	for _, i := range slots {
		off := attachMsgOff + 8*(i/64)
		le.PutUint64(resp[off:], le.Uint64(resp[off:])|1<<(i%64))
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	_, _, _ = c.WriteMsgUnix(resp, oob, nil)
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

func readFull(c net.Conn, b []byte) (int, error) {
	n := 0
	for n < len(b) {
		m, err := c.Read(b[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// claim gives pid a free slot, reaping dead processes' slots first.
func (s *testServer) claim(pid uint32) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reapLocked()
	for i := 0; i < region.MaxProcs; i++ {
		if s.reg.Proc(i).PID.Load() == 0 {
			// The slot gets its memfd before its owner, as the
			// enforcer's attach does (TenantFDs, then Claim).
			if err := s.reg.Prepare(i); err != nil {
				return -1
			}
			p := s.reg.Proc(i)
			p.Claim(pid, 1)
			s.taken[i/64] |= 1 << (i % 64)
			s.reg.SetUsed(s.taken)
			s.claims = append(s.claims, strconv.Itoa(int(pid)))
			return i
		}
	}
	return -1
}

// reap frees the slots of processes that no longer exist (the caller has
// waited for them, so they are not zombies).
func (s *testServer) reap() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reapLocked()
}

func (s *testServer) reapLocked() {
	for i := 0; i < region.MaxProcs; i++ {
		p := s.reg.Proc(i)
		pid := p.PID.Load()
		if pid == 0 {
			continue
		}
		if err := unix.Kill(int(pid), 0); errors.Is(err, unix.ESRCH) {
			p.Clear()
			s.taken[i/64] &^= 1 << (i % 64)
			s.reg.SetUsed(s.taken)
		}
	}
}

// slotOf returns the slot of pid, or nil.
func (s *testServer) slotOf(pid int) *region.Proc {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := 0; i < region.MaxProcs; i++ {
		if p := s.reg.Proc(i); p.PID.Load() == uint32(pid) { //nolint:gosec // pids are positive
			return &p
		}
	}
	return nil
}

// used is what the instance's allocations hold: the sum over all slots
// that have memory (a slot gets its memfd when a process first attaches to
// it) of what they reserved less what they reserved ahead, as the enforcer
// reports it.
func (s *testServer) used() uint64 {
	held, _ := s.reservedSum()
	return held
}

// reservedSum returns what the instance's allocations hold and what its
// processes reserved (with what they reserved ahead), summed over the
// slots.
func (s *testServer) reservedSum() (held, reserved uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := 0; i < region.MaxProcs; i++ {
		if c := s.reg.Proc(i).Counters; c != nil {
			r := c.MemReserved.Load()
			held += r - min(r, c.MemAhead.Load())
			reserved += r
		}
	}
	return held, reserved
}

func (s *testServer) setGrant(v uint32) { s.reg.SetGrant(v) }

// wakes discards and counts the datagrams the processes sent on the wake
// socket.
func (s *testServer) wakes() int {
	n := 0
	var b [8]byte
	for {
		if _, _, err := unix.Recvfrom(s.wake[0], b[:], unix.MSG_DONTWAIT); err != nil {
			return n
		}
		n++
	}
}

// claimedPids lists the pids that attached, in order.
func (s *testServer) claimedPids() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.claims...)
}
