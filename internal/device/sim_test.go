package device

import (
	"testing"

	"github.com/mgpu-dev/mgpu/internal/config"
)

func TestSimFromConfig(t *testing.T) {
	t.Parallel()
	cfg, err := config.Load("../../packaging/config/sim-node.toml")
	if err != nil {
		t.Fatal(err)
	}
	b, err := Open(cfg)
	if err != nil {
		t.Fatal(err)
	}
	devs, err := b.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 2 {
		t.Fatalf("got %d devices, want 2", len(devs))
	}
	for i, d := range devs {
		if d.Index != i || d.Name != "Simulated-GPU-80GB" || d.MemoryMiB() != 81920 || d.UUID != config.SimUUID(i) {
			t.Errorf("device %d: %+v", i, d)
		}
	}
	if l, err := b.Topology(0, 1); err != nil || l != LinkHostBridge {
		t.Errorf("Topology(0,1) = %q, %v", l, err)
	}
	if _, err := b.Topology(0, 2); err == nil {
		t.Error("Topology with an unknown GPU did not fail")
	}
}
