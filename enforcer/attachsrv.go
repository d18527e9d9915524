package enforcer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/procfs"
	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// maxAncestors bounds the walk up the process tree.
const maxAncestors = 1024

// maxSentFDs is the most descriptors read with a request (a client sends
// one, its own pidfd); more are closed by the kernel (MSG_CTRUNC).
const maxSentFDs = 4

// attachConn is an accepted attach connection and what was learned of its
// peer.
type attachConn struct {
	conn  *net.UnixConn
	pid   int       // SO_PEERCRED: the process that connected
	uid   uint32    // its effective uid then
	key   attachKey // whose budget the connection counts against (at the accept)
	pidfd int       // the caller's pidfd, once established (handleAttach); -1 before
	info  peerInfo  // what /proc said of pid, read before pidfd was seen alive
	ierr  error     // why /proc could not say
	read  bool      // info or ierr is set (/proc was read once, at the accept or later)
}

// serveAttach accepts attach connections. Each is identified at once
// (identifyConn) and counted against its instance's budget (attachLimiter):
// a client that floods the socket, stays silent or is slow costs only the
// budget of its own instance (or unidentified pid namespace or cgroup); the
// accept loop itself never waits for a client.
func (e *Enforcer) serveAttach(ctx context.Context) {
	lim := newAttachLimiter(e.o.log, e.handleAttach)
	e.attachLim = lim
	keys := newKeyCache()
	defer keys.close()
	for {
		conn, err := e.client.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || ctx.Err() != nil {
				return
			}
			e.o.log.Warn("accept on client socket", "err", err)
			t := time.NewTimer(10 * time.Millisecond) // EMFILE and the like: back off
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return
			}
			continue
		}
		c, err := e.identifyConn(conn, keys)
		if err != nil {
			e.refuseConn(conn, attach.Internal, "mgpu: cannot identify the caller: "+err.Error())
			continue
		}
		if msg, ok := lim.enter(c); !ok {
			e.refuseConn(conn, attach.Internal, msg)
		}
	}
}

// refuseConn answers a connection that is not served with one refusal
// (written without waiting: the socket's buffer is empty) and closes it.
func (e *Enforcer) refuseConn(conn *net.UnixConn, st attach.Status, msg string) {
	_ = conn.SetWriteDeadline(time.Now().Add(time.Millisecond))
	_ = e.reply(conn, attach.Response{Status: st, DeviceIndex: uint32(e.index), Message: msg}, nil) //nolint:gosec // small
	_ = conn.Close()
}

func closePidfd(c *attachConn) {
	if c.pidfd >= 0 {
		_ = unix.Close(c.pidfd)
		c.pidfd = -1
	}
}

// identifyConn learns, before reading a byte, whose budget a connection
// counts against: the caller's instance, from SO_PEERCRED's pid and /proc
// (or the key cache, while the process it names lives). What it reads is
// not the caller's identity: handleAttach establishes that.
func (e *Enforcer) identifyConn(conn *net.UnixConn, keys *keyCache) (*attachConn, error) {
	cred, err := peerCred(conn)
	if err != nil {
		return nil, err
	}
	c := &attachConn{conn: conn, pid: int(cred.Pid), uid: cred.Uid, pidfd: -1}
	if k, ok := keys.get(c.pid); ok {
		c.key = k
		return c, nil
	}
	c.key = unidentifiedKey
	info, err := e.inspect(c.pid)
	// What /proc says now is what handleAttach would read: it is believed
	// only once the caller's pidfd, established later, shows the process
	// alive (callerInfo), and the pid cannot name another process before
	// that one has exited.
	c.info, c.ierr, c.read = info, err, true
	if err != nil {
		return c, nil
	}
	e.mu.Lock()
	in := e.matchLocked(info)
	e.mu.Unlock()
	c.key = keyOf(in, info)
	// The cache keeps a pidfd of the process the key was read for: the
	// kernel's own of the caller (its /proc was read after it connected, so
	// while it lives the pid names it), else one opened now and checked
	// against the start time read.
	fd, err := peerPidfd(conn)
	if err != nil {
		fd, err = e.pidfd(c.pid, info.startTime)
	}
	if err == nil {
		keys.put(c.pid, c.key, fd)
	}
	return c, nil
}

// handleAttach serves one connection: read the request (within the
// request deadline), establish the caller's pidfd, answer with its
// instance's region or a refusal.
func (e *Enforcer) handleAttach(c *attachConn) {
	conn := c.conn
	defer func() { _ = conn.Close() }()
	defer closePidfd(c)
	_ = conn.SetDeadline(time.Now().Add(e.o.attachTimeout))
	buf, sent, err := readRequest(conn)
	defer closeFDs(sent)
	if err != nil {
		return // incomplete request: close this connection only
	}
	req, err := attach.DecodeRequest(buf[:])
	if err != nil {
		// A shim of another protocol version gets the refusal in its own
		// version, so that it prints the message instead of failing on
		// the layout.
		v := attach.Version
		if req.Magic == attach.Magic && req.Version != 0 {
			v = req.Version
		}
		e.attachLim.logRefused(c.key, "attach requests refused", "err", err)
		_ = e.reply(conn, attach.Response{Version: v, Status: attach.BadRequest, Message: "mgpu: " + err.Error()}, nil)
		return
	}
	// The caller: the kernel's pidfd of the process that connected, or on
	// Linux < 6.5 the one the client sent of itself, which must hold this
	// connection. /proc is read once the process is pinned, and believed
	// only while the pidfd shows it alive (callerInfo).
	if c.pidfd, err = peerPidfd(conn); err != nil {
		c.pidfd, err = sentPidfd(conn, sent, c.pid, c.uid, req)
		_ = conn.SetDeadline(time.Now().Add(e.o.attachTimeout))
		if err != nil {
			_ = e.reply(conn, attach.Response{Status: attach.Internal, Message: "mgpu: cannot identify the caller: " + err.Error()}, nil)
			return
		}
	}
	switch req.Flags {
	case attach.FlagPeers, attach.FlagWake:
		var (
			resp attach.Response
			fds  []int
		)
		if req.Flags == attach.FlagPeers {
			resp, fds = e.peers(c)
		} else {
			resp, fds = e.wakeSocket(c)
		}
		_ = e.reply(conn, resp, fds)
		closeFDs(fds)
		return
	}
	if !c.read {
		c.info, c.ierr = e.inspect(c.pid)
	}
	resp, fds, in, slot := e.attach(c)
	if fds == nil {
		_ = e.reply(conn, resp, nil)
		return
	}
	err = e.reply(conn, resp, fds)
	closeFDs(fds)
	if err != nil {
		// The caller went away before it got its region: free the slot.
		e.mu.Lock()
		if e.byID[in.id] == in {
			e.guard(func() { e.reapSlotLocked(in, slot) })
		}
		e.mu.Unlock()
		return
	}
	e.kickLoop()
}

// readRequest reads one request and the descriptors sent with it.
func readRequest(conn *net.UnixConn) ([attach.RequestSize]byte, []int, error) {
	var (
		buf [attach.RequestSize]byte
		fds []int
		n   int
	)
	oob := make([]byte, unix.CmsgSpace(4*maxSentFDs))
	for n < len(buf) {
		m, oobn, _, _, err := conn.ReadMsgUnix(buf[n:], oob)
		fds = append(fds, parseRights(oob[:oobn])...)
		if err == nil && m == 0 {
			err = errors.New("connection closed")
		}
		if err != nil {
			return buf, fds, err
		}
		n += m
	}
	return buf, fds, nil
}

// parseRights returns the descriptors of SCM_RIGHTS messages in oob.
func parseRights(oob []byte) []int {
	if len(oob) == 0 {
		return nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for i := range msgs {
		if f, err := unix.ParseUnixRights(&msgs[i]); err == nil {
			fds = append(fds, f...)
		}
	}
	return fds
}

// closeFDs closes descriptors a reply carried (or would have).
func closeFDs(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

func (e *Enforcer) reply(conn *net.UnixConn, r attach.Response, fds []int) error {
	b := r.Marshal()
	var oob []byte
	if fds != nil {
		oob = unix.UnixRights(fds...)
	}
	_, _, err := conn.WriteMsgUnix(b[:], oob, nil)
	return err
}

// peerCred returns the credentials the kernel recorded of the process that
// connected (SO_PEERCRED). Its pid is a number: it may name another process
// by the time it is used, so it only chooses a budget (identifyConn).
func peerCred(conn *net.UnixConn) (*unix.Ucred, error) {
	raw, err := conn.SyscallConn()
	if err != nil {
		return nil, err
	}
	var (
		cred *unix.Ucred
		cerr error
	)
	err = raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) //nolint:gosec // fds fit in int
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	if cred.Pid <= 0 {
		return nil, errors.New("the caller's pid is not visible from the enforcer's pid namespace")
	}
	return cred, nil
}

// peerPidfd returns a pidfd of the very process that connected
// (SO_PEERPIDFD, Linux >= 6.5), or an error where the kernel has none. A pid
// number is never turned into a pidfd: by then the process may have exited
// and the number may name a process of another instance.
func peerPidfd(conn *net.UnixConn) (int, error) {
	raw, err := conn.SyscallConn()
	if err != nil {
		return -1, err
	}
	pidfd := -1
	cerr := raw.Control(func(fd uintptr) {
		pidfd, err = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD) //nolint:gosec // fds fit in int
	})
	if cerr != nil {
		return -1, cerr
	}
	if err != nil {
		return -1, fmt.Errorf("SO_PEERPIDFD: %w", err)
	}
	return pidfd, nil
}

// sentPidfd establishes the caller's pidfd on Linux < 6.5, where the
// kernel gives none of a peer, from what the client sent with its request
// (mgpu_region.h): exactly one descriptor, a pidfd of a live process whose
// pid and effective uid are those the kernel recorded at connect and which
// holds this very connection at req.SockFD. That last check is what a
// process whose pid number was reused cannot pass: the enforcer fetches the
// descriptor (pidfd_getfd), checks it is a connection to this socket, shuts
// its writing down (the client has sent all it sends) and must see the end
// of its own side at once. It returns a duplicate the caller closes.
func sentPidfd(conn *net.UnixConn, sent []int, pid int, uid uint32, req attach.Request) (int, error) {
	if len(sent) != 1 || req.SockFD == 0 {
		return -1, fmt.Errorf("this kernel has no SO_PEERPIDFD (Linux < 6.5) and the client sent %d descriptors and no descriptor number, want its own pidfd and its socket's; install the libmgpu-shim.so of the enforcer's release", len(sent))
	}
	fd := sent[0]
	got, err := pidfdPid(fd)
	if err != nil {
		return -1, err
	}
	if got != pid {
		return -1, fmt.Errorf("the pidfd sent is of pid %d, the caller is pid %d", got, pid)
	}
	var st unix.Stat_t
	if err := unix.Stat("/proc/"+strconv.Itoa(pid), &st); err != nil {
		return -1, fmt.Errorf("pid %d: %w", pid, err)
	}
	if st.Uid != uid {
		return -1, fmt.Errorf("pid %d runs as uid %d, the caller connected as uid %d", pid, st.Uid, uid)
	}
	if err := holdsConn(conn, fd, int(req.SockFD-1)); err != nil {
		return -1, fmt.Errorf("pid %d: %w", pid, err)
	}
	if procfs.PidfdExited(fd) {
		return -1, fmt.Errorf("pid %d: %w", pid, os.ErrProcessDone)
	}
	return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) //nolint:gosec // a valid fd
}

// holdsConn checks that the process of pidfd holds the client's end of conn
// at descriptor n. It leaves conn without a deadline.
func holdsConn(conn *net.UnixConn, pidfd, n int) error {
	errNot := errors.New("is not the process that connected")
	f, err := unix.PidfdGetfd(pidfd, n, 0)
	if err != nil {
		return fmt.Errorf("%w (pidfd_getfd: %w)", errNot, err)
	}
	defer func() { _ = unix.Close(f) }()
	var st unix.Stat_t
	if err := unix.Fstat(f, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return errNot
	}
	// Only a connection to this socket is touched: another descriptor of
	// the process at that number (a pid reused by a stranger) is left as it
	// is.
	if sa, err := unix.Getpeername(f); err != nil {
		return errNot
	} else if un, ok := sa.(*unix.SockaddrUnix); !ok || un.Name != conn.LocalAddr().String() {
		return errNot
	}
	if err := unix.Shutdown(f, unix.SHUT_WR); err != nil {
		return errNot
	}
	_ = conn.SetReadDeadline(time.Now().Add(connProofWait))
	defer func() { _ = conn.SetReadDeadline(time.Time{}) }()
	var b [1]byte
	if n, err := conn.Read(b[:]); n != 0 || !errors.Is(err, io.EOF) {
		return errNot
	}
	return nil
}

// connProofWait bounds the wait for the end of a connection whose writing
// holdsConn shut down: the end of the caller's own is there at once.
const connProofWait = 50 * time.Millisecond

// pidfdPid returns the pid (in the enforcer's pid namespace) of the process
// a pidfd refers to, from its fdinfo; an error for a descriptor that is not
// a pidfd or whose process has exited (Pid: -1).
func pidfdPid(fd int) (int, error) {
	if link, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd)); err != nil || !strings.Contains(link, "pidfd") {
		return 0, errors.New("the descriptor sent is not a pidfd")
	}
	b, err := os.ReadFile("/proc/self/fdinfo/" + strconv.Itoa(fd))
	if err != nil {
		return 0, fmt.Errorf("the descriptor sent: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		v, ok := strings.CutPrefix(line, "Pid:")
		if !ok {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil || pid <= 0 {
			return 0, errors.New("the pidfd sent is of a process that has exited")
		}
		return pid, nil
	}
	return 0, errors.New("the descriptor sent is not a pidfd")
}

// peerInfo is what /proc says about an attaching process.
type peerInfo struct {
	pid       int
	startTime uint64
	pidNS     uint64
	cgroups   []string
	ancestors []ancestor // the process itself first, then its parent, ...
}

type ancestor struct {
	pid       int
	startTime uint64
	// pinned: the root of a process-tree instance that holds a pidfd of
	// it, met in the walk; its start time was not read (matchLocked asks
	// the pidfd instead whether pid still names that root).
	pinned bool
}

// inspect reads what /proc says of pid that matching it against the
// instances of the moment needs (matchNeeds): its start time and pid
// namespace; its cgroups where a container instance is matched by cgroup
// and none by that namespace; its ancestors up to the nearest root of a
// process-tree instance (matchLocked looks no further: the nearest root it
// finds wins) where the device has such instances. An instance created or
// released between the read and the match is missed or not found, as if
// the process had attached just before or after it.
func (e *Enforcer) inspect(pid int) (peerInfo, error) {
	p := peerInfo{pid: pid}
	st, err := e.o.proc.Stat(pid)
	if err != nil {
		return p, err
	}
	p.startTime = st.StartTime
	if p.pidNS, err = e.o.proc.PidNS(pid); err != nil {
		return p, err
	}
	p.ancestors = append(p.ancestors, ancestor{pid: pid, startTime: st.StartTime})
	need := e.matchNeeds(p.pidNS)
	if need.byNS {
		return p, nil
	}
	if need.cgroups {
		if p.cgroups, err = e.o.proc.Cgroups(pid); err != nil {
			return p, err
		}
	}
	if len(need.roots) == 0 || need.roots[p.ancestors[0]] {
		return p, nil
	}
	for next := st.PPID; next > 0 && len(p.ancestors) < maxAncestors; {
		if need.pinned[next] {
			// Should that root have died and its pid now name another
			// ancestor, the walk ends here and the process is in no
			// instance (refused), never in a wrong one.
			p.ancestors = append(p.ancestors, ancestor{pid: next, pinned: true})
			break
		}
		ast, err := e.o.proc.Stat(next)
		if err != nil {
			break
		}
		a := ancestor{pid: next, startTime: ast.StartTime}
		p.ancestors = append(p.ancestors, a)
		if need.roots[a] {
			break
		}
		next = ast.PPID
	}
	return p, nil
}

// matchNeeds is what matchLocked needs to know of a process, given the
// instances of the moment.
type matchNeeds struct {
	byNS    bool              // a container instance holds its pid namespace: nothing more
	cgroups bool              // a container instance is matched by cgroup
	roots   map[ancestor]bool // the roots (pid, start time) of the process-tree instances
	pinned  map[int]bool      // the pids of those roots the enforcer holds a pidfd of
}

func (e *Enforcer) matchNeeds(pidNS uint64) matchNeeds {
	e.mu.Lock()
	defer e.mu.Unlock()
	var n matchNeeds
	for _, in := range e.list {
		switch {
		case in.kind == api.KindContainer && pidNS != 0 && pidNS != e.selfNS && in.pidNS == pidNS:
			return matchNeeds{byNS: true}
		case in.kind == api.KindContainer && in.cgroup != "":
			n.cgroups = true
		case in.kind == api.KindProcessTree:
			if n.roots == nil {
				n.roots = map[ancestor]bool{}
			}
			n.roots[ancestor{pid: in.pid, startTime: in.startTime}] = true
			if in.rootFD >= 0 {
				if n.pinned == nil {
					n.pinned = map[int]bool{}
				}
				n.pinned[in.pid] = true
			}
		}
	}
	return n
}

// matchLocked finds the instance a process belongs to: a container by its
// pid namespace (when it is not the enforcer's), else a container by
// cgroup (the deepest that contains the process), else a process tree whose
// root (pid and start time) is the process or one of its ancestors.
func (e *Enforcer) matchLocked(p peerInfo) *instance {
	if p.pidNS != 0 && p.pidNS != e.selfNS {
		for _, in := range e.list {
			if in.kind == api.KindContainer && in.pidNS == p.pidNS {
				return in
			}
		}
	}
	var best *instance
	for _, in := range e.list {
		if in.kind != api.KindContainer || in.cgroup == "" || (best != nil && len(in.cgroup) <= len(best.cgroup)) {
			continue
		}
		for _, cg := range p.cgroups {
			if cg == in.cgroup || under(cg, in.cgroup) {
				best = in
				break
			}
		}
	}
	if best != nil {
		return best
	}
	for _, a := range p.ancestors {
		for _, in := range e.list {
			if in.kind == api.KindProcessTree && in.pid == a.pid && in.rootMatches(a) {
				return in
			}
		}
	}
	return nil
}

// rootMatches reports whether ancestor a, of in's root pid, is that root:
// by start time, or for a pinned one by in's pidfd of it, which shows
// whether the root still lives (and so still owns its pid).
func (in *instance) rootMatches(a ancestor) bool {
	if a.pinned {
		return in.rootFD >= 0 && !procfs.PidfdExited(in.rootFD)
	}
	return in.startTime == a.startTime
}

func under(p, base string) bool {
	return len(p) > len(base) && p[:len(base)] == base && p[len(base)] == '/' && base != "/"
}

// callerInfo returns what /proc said of a caller, checked against its
// pidfd: the process was read before the pidfd showed it alive, so what was
// read is of that very process. When that does not hold, ok is false and
// resp is the refusal to send.
func (e *Enforcer) callerInfo(c *attachConn) (resp attach.Response, info peerInfo, ok bool) {
	resp = attach.Response{DeviceIndex: uint32(e.index)} //nolint:gosec // small
	err := c.ierr
	if err == nil && procfs.PidfdExited(c.pidfd) {
		err = os.ErrProcessDone
	}
	if err != nil {
		resp.Status = attach.Internal
		resp.Message = fmt.Sprintf("mgpu: cannot inspect pid %d: %v", c.pid, err)
		return resp, c.info, false
	}
	return resp, c.info, true
}

// attach maps a peer to its instance and gives it a slot, which takes the
// caller's pidfd to watch its exit. On success it returns the descriptors
// the reply carries (region.TenantFDs; the caller closes them), opened
// under the lock, so that a concurrent release cannot make the reply carry
// another instance's files.
func (e *Enforcer) attach(c *attachConn) (attach.Response, []int, *instance, int) {
	pid, pidfd := c.pid, c.pidfd
	resp, info, ok := e.callerInfo(c)
	if !ok {
		return resp, nil, nil, 0
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	var (
		fds  []int
		slot = -1
		in   *instance
	)
	if e.guard(func() { resp, fds, in, slot = e.attachLocked(resp, pid, pidfd, info) }) {
		closeFDs(fds)
		resp.Status = attach.Internal
		resp.Message = "mgpu: the instance's region was truncated by one of its processes; the instance is released"
		return resp, nil, nil, 0
	}
	if fds != nil {
		c.pidfd = -1 // the slot's now
	}
	return resp, fds, in, slot
}

func (e *Enforcer) attachLocked(resp attach.Response, pid, pidfd int, info peerInfo) (attach.Response, []int, *instance, int) {
	in := e.matchLocked(info)
	if in == nil || e.closed {
		resp.Status = attach.NoInstance
		resp.Message = fmt.Sprintf("mgpu: pid %d belongs to no mgpu instance on device %d; start it with mgpu-cli run or in a container with --device %s=%d",
			pid, e.index, e.cfg.CDIKind, e.index)
		return resp, nil, nil, 0
	}
	slot := -1
	in.forSlots(func(i int) {
		p := in.reg.Proc(i)
		if slot < 0 && int(p.PID.Load()) == pid && p.StartTime.Load() == info.startTime {
			slot = i // the same process attaches again (after exec): start its slot over
		}
	})
	if slot >= 0 {
		e.reapSlotLocked(in, slot)
	} else {
		for i := range region.MaxProcs {
			if !in.slotUsed(i) {
				slot = i
				break
			}
		}
	}
	if slot < 0 {
		resp.Status = attach.NoSlot
		resp.Message = fmt.Sprintf("mgpu: instance %s already has %d processes attached, the most a region holds", in.name, region.MaxProcs)
		return resp, nil, nil, 0
	}
	// The slot's counters start at zero (a reaped slot was cleared; this
	// also clears what a process of the same pid wrote before an exec).
	in.reg.Proc(slot).Clear()
	fds, err := in.reg.TenantFDs(e.view, slot)
	if err != nil {
		resp.Status = attach.Internal
		resp.Message = "mgpu: " + err.Error()
		return resp, nil, nil, 0
	}
	in.reg.Proc(slot).Claim(uint32(pid), info.startTime) //nolint:gosec // pids fit
	in.sane[slot] = sane{}
	in.setUsed(slot)
	// The caller's pidfd is the slot's from here (last: a fault above
	// leaves it the caller's to close).
	in.slotFD[slot] = e.watchLocked(pidfd, watchRef{in: in, slot: slot})
	e.o.log.Debug("attached", "instance", in.name, "slot", slot, "pid", pid)
	resp.Status = attach.OK
	resp.Slot = uint32(slot) //nolint:gosec // < MaxProcs
	resp.ControlSize = region.ControlFileSize
	resp.ProcSize = region.ProcFileSize
	resp.InstanceID = uint32(in.id) //nolint:gosec // small
	return resp, fds, in, slot
}

// forAttached answers a request of an attached process about its own
// instance: answer runs under the lock with the caller's instance and slot
// and fills in what the request is for; a caller that is not attached is
// refused.
func (e *Enforcer) forAttached(c *attachConn, answer func(resp *attach.Response, in *instance, own int) []int) (attach.Response, []int) {
	resp := attach.Response{DeviceIndex: uint32(e.index)} //nolint:gosec // small
	if procfs.PidfdExited(c.pidfd) {
		resp.Status = attach.Internal
		resp.Message = fmt.Sprintf("mgpu: cannot inspect pid %d: %v", c.pid, os.ErrProcessDone)
		return resp, nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	in, own := e.slotOfLocked(c.pid)
	if own < 0 {
		resp.Status = attach.NoInstance
		resp.Message = fmt.Sprintf("mgpu: pid %d is not attached to an instance of device %d", c.pid, e.index)
		return resp, nil
	}
	resp.Slot = uint32(own)         //nolint:gosec // < MaxProcs
	resp.InstanceID = uint32(in.id) //nolint:gosec // small
	resp.ControlSize, resp.ProcSize = region.ControlFileSize, region.ProcFileSize
	fds := answer(&resp, in, own)
	return resp, fds
}

// slotOfLocked finds the slot that the live process pid holds, without
// reading /proc: a slot claimed by pid whose owner (the slot's pidfd) still
// lives is that process's, since no two live processes share a pid.
func (e *Enforcer) slotOfLocked(pid int) (*instance, int) {
	for _, in := range e.list {
		own := -1
		in.forSlots(func(i int) {
			if own < 0 && int(in.reg.Proc(i).PID.Load()) == pid && in.slotFD[i] >= 0 && !procfs.PidfdExited(in.slotFD[i]) {
				own = i
			}
		})
		if own >= 0 {
			return in, own
		}
	}
	return nil, -1
}

// wakeSocket answers an attached process's request for its instance's wake
// socket (wake.go).
func (e *Enforcer) wakeSocket(c *attachConn) (attach.Response, []int) {
	return e.forAttached(c, func(resp *attach.Response, in *instance, _ int) []int {
		fd, err := e.wakeFDLocked(in)
		if err != nil {
			resp.Status = attach.Internal
			resp.Message = "mgpu: the instance's wake socket: " + err.Error()
			return nil
		}
		return []int{fd}
	})
}

// peers answers an attached process's request for the read-only proc files
// of the other attached processes of its instance.
func (e *Enforcer) peers(c *attachConn) (attach.Response, []int) {
	return e.forAttached(c, func(resp *attach.Response, in *instance, own int) []int {
		var slots []int
		in.forSlots(func(i int) {
			if i != own {
				slots = append(slots, i)
				resp.Peers[i/64] |= 1 << (i % 64)
			}
		})
		fds, err := in.reg.PeerFDs(e.view, slots)
		if err != nil {
			resp.Status = attach.Internal
			resp.Message = "mgpu: " + err.Error()
			resp.Peers = [2]uint64{}
			return nil
		}
		if len(fds) == 0 {
			return nil // no SCM_RIGHTS message
		}
		return fds
	})
}
