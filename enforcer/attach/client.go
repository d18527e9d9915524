package attach

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Result is a successful attach: the response and the region's files, which
// the caller maps (MAP_SHARED) and closes (Close).
type Result struct {
	Response
	Control *os.File // the control file, read-only (ControlSize bytes)
	Own     *os.File // the caller's proc file, read-write (ProcSize bytes)
}

// Close closes the result's files.
func (r *Result) Close() {
	for _, f := range []*os.File{r.Control, r.Own} {
		if f != nil {
			_ = f.Close()
		}
	}
}

// RefusedError is an attach the enforcer answered with a status other than
// OK; its text is the enforcer's message.
type RefusedError struct {
	Status  Status
	Message string
}

func (e *RefusedError) Error() string {
	if e.Message == "" {
		return "attach refused: " + e.Status.String()
	}
	return e.Message
}

// Dial attaches the calling process to its instance through the client
// socket at path, like the shim does.
func Dial(path string, timeout time.Duration) (*Result, error) {
	req := NewRequest().Marshal()
	return DialRequest(path, req[:], timeout)
}

// DialRequest sends raw request bytes (tests send malformed ones) and reads
// the response of an attach.
func DialRequest(path string, req []byte, timeout time.Duration) (*Result, error) {
	resp, fds, err := exchange(path, req, timeout)
	if err != nil {
		return nil, err
	}
	if len(fds) != FDs {
		closeAll(fds)
		return nil, fmt.Errorf("attach: response with %d descriptors, want %d", len(fds), FDs)
	}
	return &Result{Response: resp, Control: os.NewFile(uintptr(fds[0]), "control"), Own: os.NewFile(uintptr(fds[1]), "own proc")}, nil //nolint:gosec // fds are non-negative
}

// Peers asks, as an attached process, for the read-only proc files of the
// other attached processes of its instance, by slot. The caller closes them.
func Peers(path string, timeout time.Duration) (map[int]*os.File, error) {
	req := Request{Magic: Magic, Version: Version, Flags: FlagPeers}.Marshal()
	resp, fds, err := exchange(path, req[:], timeout)
	if err != nil {
		return nil, err
	}
	out := map[int]*os.File{}
	for slot := range maxProcs {
		if resp.Peers[slot/64]&(1<<(slot%64)) == 0 {
			continue
		}
		if len(fds) == 0 {
			break
		}
		out[slot] = os.NewFile(uintptr(fds[0]), "proc") //nolint:gosec // fds are non-negative
		fds = fds[1:]
	}
	if len(fds) > 0 {
		closeAll(fds)
		for _, f := range out {
			_ = f.Close()
		}
		return nil, errors.New("attach: peers response with more descriptors than slots")
	}
	return out, nil
}

// Wake asks, as an attached process, for its instance's wake socket (the
// sending end; mgpu_region.h, MGPU_ATTACH_FLAG_WAKE). The caller closes it.
func Wake(path string, timeout time.Duration) (*os.File, error) {
	req := Request{Magic: Magic, Version: Version, Flags: FlagWake}.Marshal()
	_, fds, err := exchange(path, req[:], timeout)
	if err != nil {
		return nil, err
	}
	if len(fds) != 1 {
		closeAll(fds)
		return nil, fmt.Errorf("attach: wake response with %d descriptors, want 1", len(fds))
	}
	return os.NewFile(uintptr(fds[0]), "wake"), nil //nolint:gosec // fds are non-negative
}

// withSockFD returns a request that names the client's descriptor of conn
// (Request.SockFD), unless it is not a whole request or names one already.
func withSockFD(conn *net.UnixConn, req []byte) []byte {
	if len(req) != RequestSize || binary.LittleEndian.Uint32(req[12:]) != 0 {
		return req
	}
	raw, err := conn.SyscallConn()
	if err != nil {
		return req
	}
	out := append([]byte(nil), req...)
	_ = raw.Control(func(fd uintptr) { binary.LittleEndian.PutUint32(out[12:], uint32(fd)+1) }) //nolint:gosec // fds fit in uint32
	return out
}

func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// exchange sends one request and reads one response with its descriptors;
// a refusal is a *RefusedError.
func exchange(path string, req []byte, timeout time.Duration) (Response, []int, error) {
	conn, err := net.DialTimeout("unix", path, timeout)
	if err != nil {
		return Response{}, nil, fmt.Errorf("attach: %w", err)
	}
	defer func() { _ = conn.Close() }()
	uc := conn.(*net.UnixConn)
	if err := uc.SetDeadline(time.Now().Add(timeout)); err != nil {
		return Response{}, nil, fmt.Errorf("attach: %w", err)
	}
	// With a pidfd of this process, as the shim does (an enforcer on
	// Linux < 6.5 identifies the caller by it).
	var rights []byte
	if pfd, err := unix.PidfdOpen(os.Getpid(), 0); err == nil {
		defer func() { _ = unix.Close(pfd) }()
		rights = unix.UnixRights(pfd)
		req = withSockFD(uc, req)
	}
	if _, _, err := uc.WriteMsgUnix(req, rights, nil); err != nil {
		return Response{}, nil, fmt.Errorf("attach: send request: %w", err)
	}
	buf := make([]byte, ResponseSize)
	oob := make([]byte, unix.CmsgSpace(4*(maxProcs+2)))
	n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return Response{}, nil, fmt.Errorf("attach: read response: %w", err)
	}
	var fds []int
	if oobn > 0 {
		msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
		if perr == nil {
			for _, m := range msgs {
				if f, rerr := unix.ParseUnixRights(&m); rerr == nil {
					fds = append(fds, f...)
				}
			}
		}
	}
	closeFDs := func() {
		for _, fd := range fds {
			_ = unix.Close(fd)
		}
	}
	// A stream may deliver the response in pieces; the fd comes with the
	// first byte.
	for n < ResponseSize {
		m, rerr := uc.Read(buf[n:])
		if rerr != nil {
			closeFDs()
			return Response{}, nil, fmt.Errorf("attach: read response: %w", rerr)
		}
		n += m
	}
	resp, err := DecodeResponse(buf)
	if err != nil {
		closeFDs()
		return Response{}, nil, fmt.Errorf("attach: %w", err)
	}
	if resp.Status != OK {
		closeFDs()
		return Response{}, nil, &RefusedError{Status: resp.Status, Message: resp.Message}
	}
	if resp.Version != Version {
		closeFDs()
		return Response{}, nil, fmt.Errorf("attach: response of protocol version %d, this client speaks %d", resp.Version, Version)
	}
	return resp, fds, nil
}
