//go:build cgo

package attach

import (
	"strings"
	"testing"

	"github.com/mgpu-dev/mgpu/enforcer/internal/cheader"
)

// TestWireMatchesHeader checks the encoder's offsets and the constants
// against mgpu_region.h as compiled by the C compiler.
func TestWireMatchesHeader(t *testing.T) {
	t.Parallel()
	want := map[string]uint64{
		"sizeof(mgpu_attach_req_t)":       RequestSize,
		"mgpu_attach_req_t.magic":         0,
		"mgpu_attach_req_t.version":       4,
		"mgpu_attach_req_t.flags":         8,
		"mgpu_attach_req_t.sock_fd":       12,
		"sizeof(mgpu_attach_resp_t)":      ResponseSize,
		"mgpu_attach_resp_t.magic":        0,
		"mgpu_attach_resp_t.version":      4,
		"mgpu_attach_resp_t.status":       8,
		"mgpu_attach_resp_t.slot":         12,
		"mgpu_attach_resp_t.control_size": 16,
		"mgpu_attach_resp_t.device_index": 20,
		"mgpu_attach_resp_t.instance_id":  24,
		"mgpu_attach_resp_t.proc_size":    28,
		"mgpu_attach_resp_t.message":      32,
		"mgpu_attach_resp_t.peers":        32,
		"MGPU_ATTACH_FLAG_PEERS":          uint64(FlagPeers),
		"MGPU_ATTACH_FLAG_WAKE":           uint64(FlagWake),
		"MGPU_ATTACH_MAGIC":               uint64(Magic),
		"MGPU_ATTACH_VERSION":             uint64(Version),
		"MGPU_ATTACH_FDS":                 FDs,
		"MGPU_ATTACH_OK":                  uint64(OK),
		"MGPU_ATTACH_NO_INSTANCE":         uint64(NoInstance),
		"MGPU_ATTACH_NO_SLOT":             uint64(NoSlot),
		"MGPU_ATTACH_BAD_REQUEST":         uint64(BadRequest),
		"MGPU_ATTACH_INTERNAL":            uint64(Internal),
		"MGPU_ATTACH_MESSAGE_LEN":         MessageLen,
	}
	c := cheader.Values()
	for name, v := range want {
		if cv, ok := c[name]; !ok || cv != v {
			t.Errorf("%s: C has %d (present %v), Go encodes %d", name, cv, ok, v)
		}
	}
	for name := range c {
		if _, ok := want[name]; !ok && (strings.Contains(name, "mgpu_attach_") || strings.HasPrefix(name, "MGPU_ATTACH_")) {
			t.Errorf("%s: in the C table but not checked", name)
		}
	}
	// The encoder really writes the fields at those offsets.
	b := Response{Status: NoSlot, Slot: 0x11, ControlSize: 0x22, DeviceIndex: 0x33, InstanceID: 0x44, ProcSize: 0x55, Message: "m"}.Marshal()
	for off, v := range map[int]byte{4: byte(Version), 8: 2, 12: 0x11, 16: 0x22, 20: 0x33, 24: 0x44, 28: 0x55, 32: 'm'} {
		if b[off] != v {
			t.Errorf("byte %d is %#x, want %#x", off, b[off], v)
		}
	}
}
