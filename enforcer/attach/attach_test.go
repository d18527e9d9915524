package attach

import (
	"errors"
	"strings"
	"testing"
)

func TestRequestRoundTrip(t *testing.T) {
	t.Parallel()
	b := NewRequest().Marshal()
	r, err := DecodeRequest(b[:])
	if err != nil || r != NewRequest() {
		t.Fatalf("got %+v, %v", r, err)
	}
	for _, tc := range []struct {
		name string
		mod  func(*Request)
		size int
	}{
		{"magic", func(r *Request) { r.Magic = 1 }, RequestSize},
		{"version 1", func(r *Request) { r.Version = 1 }, RequestSize},
		{"version 3", func(r *Request) { r.Version = 3 }, RequestSize},
		{"flags", func(r *Request) { r.Flags = 3 }, RequestSize},
		{"short", func(*Request) {}, RequestSize - 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := NewRequest()
			tc.mod(&r)
			b := r.Marshal()
			if _, err := DecodeRequest(b[:tc.size]); !errors.Is(err, ErrBadRequest) {
				t.Fatalf("err %v, want ErrBadRequest", err)
			}
		})
	}
}

func TestResponseRoundTrip(t *testing.T) {
	t.Parallel()
	in := Response{Version: Version, Status: NoInstance, Slot: 3, ControlSize: 4096, ProcSize: 4096, DeviceIndex: 1, InstanceID: 9, Message: "pid 1 belongs to no mgpu instance"}
	b := in.Marshal()
	out, err := DecodeResponse(b[:])
	if err != nil || out != in {
		t.Fatalf("got %+v, %v", out, err)
	}
	// An OK answer to a peers request carries the bitmap where a refusal
	// carries its message.
	peers := Response{Version: Version, Status: OK, Slot: 2, ControlSize: 4096, ProcSize: 4096, Peers: [2]uint64{1<<5 | 1<<63, 1 << 1}}
	b = peers.Marshal()
	if out, err := DecodeResponse(b[:]); err != nil || out != peers {
		t.Fatalf("peers: got %+v, %v", out, err)
	}
	// A long message is cut to fit, NUL-terminated, on a rune boundary.
	in.Message = strings.Repeat("é", 200)
	b = in.Marshal()
	if b[ResponseSize-1] != 0 {
		t.Fatal("message not NUL-terminated")
	}
	out, err = DecodeResponse(b[:])
	if err != nil || len(out.Message) > MessageLen-1 || !strings.HasPrefix(in.Message, out.Message) || len(out.Message)%2 != 0 {
		t.Fatalf("long message decoded to %d bytes, %v", len(out.Message), err)
	}
}

// FuzzDecodeRequest: the decoder never panics, accepts only requests with
// the right magic, version and flags, and what it accepts re-encodes to the
// same bytes.
func FuzzDecodeRequest(f *testing.F) {
	good := NewRequest().Marshal()
	f.Add(good[:])
	f.Add([]byte{})
	f.Add(make([]byte, 16))
	f.Add(append(good[:], 0))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeRequest(b)
		if err != nil {
			return
		}
		// sock_fd is not checked here (the enforcer checks it only on Linux < 6.5).
		if r.Magic != Magic || r.Version != Version || (r.Flags != 0 && r.Flags != FlagPeers && r.Flags != FlagWake) {
			t.Fatalf("accepted %+v", r)
		}
		if enc := r.Marshal(); string(enc[:]) != string(b) {
			t.Fatalf("re-encoded %x, got %x", enc, b)
		}
	})
}

func FuzzDecodeResponse(f *testing.F) {
	b := Response{Status: OK, ControlSize: 4096, ProcSize: 4096, Message: "x"}.Marshal()
	f.Add(b[:])
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := DecodeResponse(b)
		if err != nil {
			return
		}
		if len(r.Message) >= MessageLen || strings.IndexByte(r.Message, 0) >= 0 {
			t.Fatalf("message %q", r.Message)
		}
	})
}
