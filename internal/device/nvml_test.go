package device

import (
	"errors"
	"fmt"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

func TestNVMLWithDGXA100Mock(t *testing.T) {
	t.Parallel()
	srv := dgxa100.New()
	for i, d := range srv.Devices {
		md := d.(*server.Device)
		idx := i
		md.GetPciInfoFunc = func() (nvml.PciInfo, nvml.Return) {
			var p nvml.PciInfo
			for j, c := range fmt.Sprintf("00000000:%02X:00.0", 0x07+idx) {
				p.BusId[j] = int8(c)
			}
			return p, nvml.SUCCESS
		}
		md.GetTopologyCommonAncestorFunc = func(other nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
			o, _ := other.GetIndex()
			if o/4 == idx/4 {
				return nvml.TOPOLOGY_NODE, nvml.SUCCESS
			}
			return nvml.TOPOLOGY_SYSTEM, nvml.SUCCESS
		}
	}
	n, err := NewNVML(srv)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = n.Close() }()
	devs, err := n.Devices()
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) != 8 {
		t.Fatalf("got %d GPUs, want 8", len(devs))
	}
	seen := map[string]bool{}
	for i, d := range devs {
		if d.Index != i {
			t.Errorf("device %d has index %d", i, d.Index)
		}
		if d.Name != "Mock NVIDIA A100-SXM4-40GB" {
			t.Errorf("device %d name %q", i, d.Name)
		}
		if d.MemoryMiB() != 40960 {
			t.Errorf("device %d memory %d MiB, want 40960", i, d.MemoryMiB())
		}
		if seen[d.UUID] || d.UUID == "" {
			t.Errorf("device %d uuid %q empty or duplicate", i, d.UUID)
		}
		seen[d.UUID] = true
		if len(d.Nodes) != 1 || d.Nodes[0] != "/dev/nvidia"+string(rune('0'+d.Minor)) {
			t.Errorf("device %d nodes %v (minor %d)", i, d.Nodes, d.Minor)
		}
		if want := fmt.Sprintf("00000000:%02X:00.0", 0x07+i); d.PCIBusID != want {
			t.Errorf("device %d PCI bus id %q, want %q", i, d.PCIBusID, want)
		}
	}
	for _, tc := range []struct {
		name string
		a, b int
		want Link
	}{
		{"same", 3, 3, LinkSame},
		{"same NUMA node", 0, 3, LinkNode},
		{"across nodes", 1, 6, LinkSystem},
	} {
		got, err := n.Topology(tc.a, tc.b)
		if err != nil || got != tc.want {
			t.Errorf("%s: Topology(%d,%d) = %q, %v; want %q", tc.name, tc.a, tc.b, got, err, tc.want)
		}
	}
}

func TestNVMLMissingDriver(t *testing.T) {
	t.Parallel()
	lib := &mock.Interface{InitFunc: func() nvml.Return { return nvml.ERROR_LIBRARY_NOT_FOUND }}
	_, err := NewNVML(lib)
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("got %v, want ErrNoDriver", err)
	}
	want := `NVIDIA driver not found (libnvidia-ml.so.1); set backend = "sim" to simulate GPUs`
	if err.Error() != want {
		t.Fatalf("message %q, want %q", err, want)
	}
}

func TestOpenNVMLWithoutDriver(t *testing.T) {
	t.Parallel()
	// The real loader on a machine without the driver must give the same
	// clear error; skip where a driver is present.
	n, err := OpenNVML()
	if err == nil {
		_ = n.Close()
		t.Skip("an NVIDIA driver is present")
	}
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("got %v, want ErrNoDriver", err)
	}
}
