// Package attach implements the wire format of the attach protocol of
// enforcer/shim/include/mgpu_region.h (one 16-byte request, one 256-byte
// response carrying the region's file descriptors) and a Go client for it.
// The enforcer serves it on /run/mgpu/gpuX/client/client.sock.
package attach

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"unicode/utf8"
)

// Constants of mgpu_region.h.
const (
	Magic      uint32 = 0x4150474d // MGPU_ATTACH_MAGIC, "MGPA" little-endian
	Version    uint32 = 2          // MGPU_ATTACH_VERSION
	MessageLen        = 224        // MGPU_ATTACH_MESSAGE_LEN
	FDs               = 2          // MGPU_ATTACH_FDS: the control file and the own proc file
	FlagPeers  uint32 = 1          // MGPU_ATTACH_FLAG_PEERS: ask for the other processes' proc files
	FlagWake   uint32 = 2          // MGPU_ATTACH_FLAG_WAKE: ask for the instance's wake socket
	maxProcs          = 128        // MGPU_REGION_MAX_PROCS

	RequestSize  = 16
	ResponseSize = 256
)

// Status is mgpu_attach_resp_t.status.
type Status int32

// Statuses (MGPU_ATTACH_*).
const (
	OK         Status = 0 // the response carries the region's descriptors
	NoInstance Status = 1 // the caller belongs to no instance of this device
	NoSlot     Status = 2 // the instance has MGPU_REGION_MAX_PROCS processes
	BadRequest Status = 3 // wrong magic, version, size or flags
	Internal   Status = 4 // enforcer-side failure
)

func (s Status) String() string {
	switch s {
	case OK:
		return "ok"
	case NoInstance:
		return "no instance"
	case NoSlot:
		return "no slot"
	case BadRequest:
		return "bad request"
	case Internal:
		return "internal error"
	}
	return fmt.Sprintf("status %d", int32(s))
}

// Request is mgpu_attach_req_t.
type Request struct {
	Magic, Version, Flags uint32
	// SockFD is the client's own descriptor of the connection plus one (0:
	// not sent): on Linux < 6.5 the enforcer checks, through the pidfd the
	// client sends, that the caller holds the connection there.
	SockFD uint32
}

// NewRequest returns the only valid request of this version.
func NewRequest() Request { return Request{Magic: Magic, Version: Version} }

// Marshal encodes r (little-endian, like the C struct on every supported
// architecture).
func (r Request) Marshal() [RequestSize]byte {
	var b [RequestSize]byte
	le := binary.LittleEndian
	le.PutUint32(b[0:], r.Magic)
	le.PutUint32(b[4:], r.Version)
	le.PutUint32(b[8:], r.Flags)
	le.PutUint32(b[12:], r.SockFD)
	return b
}

// ErrBadRequest is returned (wrapped) by DecodeRequest.
var ErrBadRequest = errors.New("bad attach request")

// DecodeRequest parses and validates one request. b must be exactly
// RequestSize bytes.
func DecodeRequest(b []byte) (Request, error) {
	if len(b) != RequestSize {
		return Request{}, fmt.Errorf("%w: %d bytes, want %d", ErrBadRequest, len(b), RequestSize)
	}
	le := binary.LittleEndian
	r := Request{Magic: le.Uint32(b[0:]), Version: le.Uint32(b[4:]), Flags: le.Uint32(b[8:]), SockFD: le.Uint32(b[12:])}
	switch {
	case r.Magic != Magic:
		return r, fmt.Errorf("%w: magic %#x, want %#x", ErrBadRequest, r.Magic, Magic)
	case r.Version != Version:
		return r, fmt.Errorf("%w: the shim speaks attach protocol %d, this enforcer speaks %d: install the libmgpu-shim.so of the enforcer's release",
			ErrBadRequest, r.Version, Version)
	case r.Flags != 0 && r.Flags != FlagPeers && r.Flags != FlagWake:
		return r, fmt.Errorf("%w: flags %#x, want 0, %d or %d", ErrBadRequest, r.Flags, FlagPeers, FlagWake)
	}
	return r, nil
}

// Response is mgpu_attach_resp_t (magic implied).
type Response struct {
	// Version is the response's protocol version; 0 means Version. A
	// refusal of a request of another version is sent in that version
	// (magic, version, status and message have the same offsets in all).
	Version     uint32
	Status      Status
	Slot        uint32
	ControlSize uint32
	DeviceIndex uint32
	InstanceID  uint32
	ProcSize    uint32
	Message     string // at most MessageLen-1 bytes travel; not with Peers
	// Peers is the bitmap of the slots whose proc files an OK answer to a
	// FlagPeers request carries (in the place of Message).
	Peers [maxProcs / 64]uint64
}

// Marshal encodes r; a long message is cut at a UTF-8 boundary so that the
// NUL-terminated field holds at most MessageLen-1 bytes.
func (r Response) Marshal() [ResponseSize]byte {
	var b [ResponseSize]byte
	le := binary.LittleEndian
	v := r.Version
	if v == 0 {
		v = Version
	}
	le.PutUint32(b[0:], Magic)
	le.PutUint32(b[4:], v)
	le.PutUint32(b[8:], uint32(r.Status)) //nolint:gosec // two's complement on the wire, like int32_t
	le.PutUint32(b[12:], r.Slot)
	le.PutUint32(b[16:], r.ControlSize)
	le.PutUint32(b[20:], r.DeviceIndex)
	le.PutUint32(b[24:], r.InstanceID)
	le.PutUint32(b[28:], r.ProcSize)
	if r.Peers != ([maxProcs / 64]uint64{}) {
		for i, w := range r.Peers {
			le.PutUint64(b[32+8*i:], w)
		}
		return b
	}
	copy(b[32:32+MessageLen-1], truncate(r.Message, MessageLen-1))
	return b
}

func truncate(s string, n int) string {
	if i := bytes.IndexByte([]byte(s), 0); i >= 0 {
		s = s[:i]
	}
	if len(s) <= n {
		return s
	}
	s = s[:n]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// DecodeResponse parses one response of any version (a refusal keeps its
// layout across versions); the caller checks Version before using the
// rest of an OK response.
func DecodeResponse(b []byte) (Response, error) {
	if len(b) != ResponseSize {
		return Response{}, fmt.Errorf("bad attach response: %d bytes, want %d", len(b), ResponseSize)
	}
	le := binary.LittleEndian
	if m := le.Uint32(b[0:]); m != Magic {
		return Response{}, fmt.Errorf("bad attach response: magic %#x", m)
	}
	msg := b[32 : 32+MessageLen-1] // the last byte is the terminator: the shim reads no further
	if i := bytes.IndexByte(msg, 0); i >= 0 {
		msg = msg[:i]
	}
	var peers [maxProcs / 64]uint64
	if Status(int32(le.Uint32(b[8:]))) == OK { //nolint:gosec // int32_t on the wire
		for i := range peers {
			peers[i] = le.Uint64(b[32+8*i:])
		}
		msg = nil
	}
	return Response{
		Peers:       peers,
		Version:     le.Uint32(b[4:]),
		Status:      Status(int32(le.Uint32(b[8:]))), //nolint:gosec // int32_t on the wire
		Slot:        le.Uint32(b[12:]),
		ControlSize: le.Uint32(b[16:]),
		DeviceIndex: le.Uint32(b[20:]),
		InstanceID:  le.Uint32(b[24:]),
		ProcSize:    le.Uint32(b[28:]),
		Message:     string(msg),
	}, nil
}
