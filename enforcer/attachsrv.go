package enforcer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/enforcer/attach"
	"github.com/mgpu-dev/mgpu/enforcer/region"
)

// maxAncestors bounds the walk up the process tree.
const maxAncestors = 1024

// serveAttach accepts attach connections, at most o.maxAttaches at a time.
func (e *Enforcer) serveAttach(ctx context.Context) {
	sem := make(chan struct{}, e.o.maxAttaches)
	for {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		conn, err := e.client.AcceptUnix()
		if err != nil {
			<-sem
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
		go func() {
			defer func() { <-sem }()
			e.handleAttach(conn)
		}()
	}
}

// handleAttach serves one attach: read the request (with a deadline), learn
// the peer from the kernel, answer with its instance's region or a refusal.
func (e *Enforcer) handleAttach(conn *net.UnixConn) {
	defer func() { _ = conn.Close() }()
	_ = conn.SetDeadline(time.Now().Add(e.o.attachTimeout))
	var buf [attach.RequestSize]byte
	if _, err := io.ReadFull(conn, buf[:]); err != nil {
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
		e.o.log.Warn("attach refused", "err", err)
		_ = e.reply(conn, attach.Response{Version: v, Status: attach.BadRequest, Message: "mgpu: " + err.Error()}, nil)
		return
	}
	pid, pidfd, err := peer(conn)
	if err != nil {
		_ = e.reply(conn, attach.Response{Status: attach.Internal, Message: "mgpu: cannot identify the caller: " + err.Error()}, nil)
		return
	}
	defer func() { _ = unix.Close(pidfd) }()
	switch req.Flags {
	case attach.FlagPeers, attach.FlagWake:
		var (
			resp attach.Response
			fds  []int
		)
		if req.Flags == attach.FlagPeers {
			resp, fds = e.peers(pid, pidfd)
		} else {
			resp, fds = e.wakeSocket(pid, pidfd)
		}
		_ = e.reply(conn, resp, fds)
		closeFDs(fds)
		return
	}
	resp, fds, in, slot := e.attach(pid, pidfd)
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

// peer returns the pid of the process that connected (SO_PEERCRED, as the
// kernel recorded it at connect) and a pidfd of that very process
// (SO_PEERPIDFD, Linux >= 6.5; pidfd_open of the pid otherwise).
func peer(conn *net.UnixConn) (int, int, error) {
	raw, err := conn.SyscallConn()
	if err != nil {
		return 0, -1, err
	}
	var (
		cred  *unix.Ucred
		pidfd = -1
		cerr  error
	)
	err = raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED) //nolint:gosec // fds fit in int
		if cerr == nil {
			if v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_PEERPIDFD); err == nil { //nolint:gosec // fds fit in int
				pidfd = v
			}
		}
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		return 0, -1, fmt.Errorf("SO_PEERCRED: %w", err)
	}
	if cred.Pid <= 0 {
		return 0, -1, errors.New("the caller's pid is not visible from the enforcer's pid namespace")
	}
	if pidfd < 0 {
		if pidfd, err = unix.PidfdOpen(int(cred.Pid), 0); err != nil {
			return 0, -1, fmt.Errorf("pidfd_open %d: %w", cred.Pid, err)
		}
	}
	return int(cred.Pid), pidfd, nil
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
}

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
	if p.cgroups, err = e.o.proc.Cgroups(pid); err != nil {
		return p, err
	}
	p.ancestors = append(p.ancestors, ancestor{pid, st.StartTime})
	for next := st.PPID; next > 0 && len(p.ancestors) < maxAncestors; {
		ast, err := e.o.proc.Stat(next)
		if err != nil {
			break
		}
		p.ancestors = append(p.ancestors, ancestor{next, ast.StartTime})
		next = ast.PPID
	}
	return p, nil
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
			if in.kind == api.KindProcessTree && in.pid == a.pid && in.startTime == a.startTime {
				return in
			}
		}
	}
	return nil
}

func under(p, base string) bool {
	return len(p) > len(base) && p[:len(base)] == base && p[len(base)] == '/' && base != "/"
}

// inspectCaller reads what /proc says of a caller that is still alive; when
// it cannot, ok is false and resp is the refusal to send.
func (e *Enforcer) inspectCaller(pid, pidfd int) (resp attach.Response, info peerInfo, ok bool) {
	resp = attach.Response{DeviceIndex: uint32(e.index)} //nolint:gosec // small
	info, err := e.inspect(pid)
	if err == nil && exited(pidfd) {
		err = os.ErrProcessDone
	}
	if err != nil {
		resp.Status = attach.Internal
		resp.Message = fmt.Sprintf("mgpu: cannot inspect pid %d: %v", pid, err)
		return resp, info, false
	}
	return resp, info, true
}

// attach maps a peer to its instance and gives it a slot. On success it
// returns the descriptors the reply carries (region.TenantFDs; the caller
// closes them), opened under the lock, so that a concurrent release cannot
// make the reply carry another instance's files.
func (e *Enforcer) attach(pid, pidfd int) (attach.Response, []int, *instance, int) {
	resp, info, ok := e.inspectCaller(pid, pidfd)
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
	wfd, err := unix.FcntlInt(uintptr(pidfd), unix.F_DUPFD_CLOEXEC, 0) //nolint:gosec // a valid fd
	if err != nil {
		closeFDs(fds)
		resp.Status = attach.Internal
		resp.Message = "mgpu: " + err.Error()
		return resp, nil, nil, 0
	}
	in.reg.Proc(slot).Claim(uint32(pid), info.startTime) //nolint:gosec // pids fit
	in.sane[slot] = sane{}
	in.setUsed(slot)
	in.slotFD[slot] = wfd
	e.watches[wfd] = watchRef{in: in, slot: slot}
	if err := e.w.add(wfd); err != nil {
		e.o.log.Warn("watch process", "pid", pid, "err", err)
	}
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
func (e *Enforcer) forAttached(pid, pidfd int, answer func(resp *attach.Response, in *instance, own int) []int) (attach.Response, []int) {
	resp, info, ok := e.inspectCaller(pid, pidfd)
	if !ok {
		return resp, nil
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	in := e.matchLocked(info)
	own := -1
	if in != nil {
		in.forSlots(func(i int) {
			if p := in.reg.Proc(i); int(p.PID.Load()) == pid && p.StartTime.Load() == info.startTime {
				own = i
			}
		})
	}
	if own < 0 {
		resp.Status = attach.NoInstance
		resp.Message = fmt.Sprintf("mgpu: pid %d is not attached to an instance of device %d", pid, e.index)
		return resp, nil
	}
	resp.Slot = uint32(own)         //nolint:gosec // < MaxProcs
	resp.InstanceID = uint32(in.id) //nolint:gosec // small
	resp.ControlSize, resp.ProcSize = region.ControlFileSize, region.ProcFileSize
	fds := answer(&resp, in, own)
	return resp, fds
}

// wakeSocket answers an attached process's request for its instance's wake
// socket (wake.go).
func (e *Enforcer) wakeSocket(pid, pidfd int) (attach.Response, []int) {
	return e.forAttached(pid, pidfd, func(resp *attach.Response, in *instance, _ int) []int {
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
func (e *Enforcer) peers(pid, pidfd int) (attach.Response, []int) {
	return e.forAttached(pid, pidfd, func(resp *attach.Response, in *instance, own int) []int {
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

// exited reports whether a pidfd's process has exited (the pidfd polls
// readable).
func exited(pidfd int) bool {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}} //nolint:gosec // fds fit in int32
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0
}
