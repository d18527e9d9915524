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

func TestSimTopologyTable(t *testing.T) {
	t.Parallel()
	cfg, err := config.Parse("c.toml", []byte("version = 1\nbackend = \"sim\"\n[sim]\ntopology = [[\"X\", \"NODE\"], [\"NODE\", \"X\"]]\n[[sim.gpu]]\n[[sim.gpu]]\n"))
	if err != nil {
		t.Fatal(err)
	}
	s := NewSim(cfg)
	if l, err := s.Topology(1, 0); err != nil || l != LinkNode || l.Rank() != 4 {
		t.Fatalf("Topology(1,0) = %q (rank %d), %v", l, l.Rank(), err)
	}
	if l, _ := s.Topology(1, 1); l != LinkSame || l.Rank() != 0 {
		t.Fatalf("Topology(1,1) = %q", l)
	}
}
