package attach

import (
	"errors"
	"fmt"
	"net"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Result is a successful attach: the response and the region file, which the
// caller maps (MAP_SHARED, RegionSize bytes) and closes.
type Result struct {
	Response
	Region *os.File
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
	oob := make([]byte, unix.CmsgSpace(4*4))
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
	if len(fds) != 1 {
		closeFDs()
		return nil, errors.New("attach: response without exactly one region descriptor")
	}
	return &Result{Response: resp, Region: os.NewFile(uintptr(fds[0]), "region")}, nil
}
