package attach

import (
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
	Control *os.File   // the control file, read-only (ControlSize bytes)
	Own     *os.File   // the caller's proc file, read-write (ProcSize bytes)
	Procs   []*os.File // every slot's proc file, read-only, by slot
}

// Close closes every file of the result.
func (r *Result) Close() {
	for _, f := range append([]*os.File{r.Control, r.Own}, r.Procs...) {
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
// the response.
func DialRequest(path string, req []byte, timeout time.Duration) (*Result, error) {
	conn, err := net.DialTimeout("unix", path, timeout)
	if err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	defer func() { _ = conn.Close() }()
	uc := conn.(*net.UnixConn)
	if err := uc.SetDeadline(time.Now().Add(timeout)); err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	if _, err := uc.Write(req); err != nil {
		return nil, fmt.Errorf("attach: send request: %w", err)
	}
	buf := make([]byte, ResponseSize)
	oob := make([]byte, unix.CmsgSpace(4*(FDs+2)))
	n, oobn, _, _, err := uc.ReadMsgUnix(buf, oob)
	if err != nil {
		return nil, fmt.Errorf("attach: read response: %w", err)
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
			return nil, fmt.Errorf("attach: read response: %w", rerr)
		}
		n += m
	}
	resp, err := DecodeResponse(buf)
	if err != nil {
		closeFDs()
		return nil, fmt.Errorf("attach: %w", err)
	}
	if resp.Status != OK {
		closeFDs()
		return nil, &RefusedError{Status: resp.Status, Message: resp.Message}
	}
	if resp.Version != Version {
		closeFDs()
		return nil, fmt.Errorf("attach: response of protocol version %d, this client speaks %d", resp.Version, Version)
	}
	if len(fds) != FDs {
		closeFDs()
		return nil, fmt.Errorf("attach: response with %d descriptors, want %d", len(fds), FDs)
	}
	res := &Result{Response: resp, Control: os.NewFile(uintptr(fds[0]), "control"), Own: os.NewFile(uintptr(fds[1]), "own proc")} //nolint:gosec // fds are non-negative
	for _, fd := range fds[2:] {
		res.Procs = append(res.Procs, os.NewFile(uintptr(fd), "proc")) //nolint:gosec // fds are non-negative
	}
	return res, nil
}
