// Package device discovers the node's GPUs through one interface with two
// backends: nvml (the NVIDIA driver, through go-nvml, loaded at run time) and
// sim (GPUs described in the node configuration).
package device

import (
	"errors"
	"fmt"
	"path/filepath"
	"sort"

	"github.com/mgpu-dev/mgpu/internal/config"
)

// Info describes one physical GPU.
type Info struct {
	Index       int      `json:"index"`
	UUID        string   `json:"uuid"`
	Name        string   `json:"name"`
	MemoryBytes uint64   `json:"memory_bytes"`
	Minor       int      `json:"minor"`
	Nodes       []string `json:"nodes"` // this GPU's device nodes, e.g. /dev/nvidia0
	PCIBusID    string   `json:"pci_bus_id,omitempty"`
}

// MemoryMiB returns the GPU's memory in MiB.
func (i Info) MemoryMiB() uint64 { return i.MemoryBytes >> 20 }

// Link is how two GPUs are connected, in nvidia-smi topo's words.
type Link string

// Links from nearest to farthest.
const (
	LinkSame       Link = "X"    // the same GPU
	LinkSingle     Link = "PIX"  // one PCIe switch
	LinkMultiple   Link = "PXB"  // several PCIe switches, no host bridge
	LinkHostBridge Link = "PHB"  // a PCIe host bridge
	LinkNode       Link = "NODE" // host bridges within one NUMA node
	LinkSystem     Link = "SYS"  // across NUMA nodes (SMP interconnect)
)

// Backend discovers GPUs.
type Backend interface {
	// Name is "nvml" or "sim".
	Name() string
	// Devices lists the GPUs, ordered by index.
	Devices() ([]Info, error)
	// ControlNodes lists the device nodes every GPU container needs
	// (/dev/nvidiactl, /dev/nvidia-uvm, ...), those that exist.
	ControlNodes() []string
	// Topology tells how GPUs a and b are connected.
	Topology(a, b int) (Link, error)
	// Close releases the backend.
	Close() error
}

// ErrNoDriver is returned by Open when the nvml backend is selected and the
// NVIDIA driver's NVML library cannot be loaded.
var ErrNoDriver = errors.New(`NVIDIA driver not found (libnvidia-ml.so.1); set backend = "sim" to simulate GPUs`)

// Open returns the backend the configuration selects.
func Open(cfg *config.Config) (Backend, error) {
	switch cfg.Backend {
	case config.BackendSim:
		return NewSim(cfg), nil
	case config.BackendNVML:
		return OpenNVML()
	default:
		return nil, fmt.Errorf("unknown backend %q", cfg.Backend)
	}
}

// List opens the backend cfg selects, lists its GPUs (ordered by index)
// and closes the backend.
func List(cfg *config.Config) ([]Info, error) {
	b, err := Open(cfg)
	if err != nil {
		return nil, err
	}
	defer func() { _ = b.Close() }()
	return b.Devices()
}

// ListWithTopology is List, and the rank (Link.Rank) of the link between
// every two of the GPUs, read in the same session of the backend. A pair
// whose link cannot be read ranks farthest.
func ListWithTopology(cfg *config.Config) ([]Info, func(a, b int) int, error) {
	b, err := Open(cfg)
	if err != nil {
		return nil, nil, err
	}
	defer func() { _ = b.Close() }()
	devs, err := b.Devices()
	if err != nil {
		return nil, nil, err
	}
	ranks := map[[2]int]int{}
	for _, x := range devs {
		for _, y := range devs {
			r := LinkSystem.Rank()
			if l, err := b.Topology(x.Index, y.Index); err == nil {
				r = l.Rank()
			}
			ranks[[2]int{x.Index, y.Index}] = r
		}
	}
	dist := func(a, b int) int {
		if r, ok := ranks[[2]int{a, b}]; ok {
			return r
		}
		return LinkSystem.Rank()
	}
	return devs, dist, nil
}

// Find returns the device with the given index.
func Find(devs []Info, index int) (Info, error) {
	for _, d := range devs {
		if d.Index == index {
			return d, nil
		}
	}
	return Info{}, fmt.Errorf("no GPU with index %d (the node has %d)", index, len(devs))
}

// Sim is the backend of simulated GPUs.
type Sim struct {
	devs     []Info
	nodeDir  string
	topology [][]string // [sim] topology (validated), or none
}

// SimNodeDir is where the simulated GPUs' device nodes live.
func SimNodeDir(cfg *config.Config) string { return filepath.Join(cfg.RunDir, "sim", "dev") }

// NewSim returns the simulated GPUs of cfg.
func NewSim(cfg *config.Config) *Sim {
	s := &Sim{nodeDir: SimNodeDir(cfg), topology: cfg.Sim.Topology}
	for i, g := range cfg.Sim.GPUs {
		s.devs = append(s.devs, Info{
			Index:       i,
			UUID:        g.UUID,
			Name:        g.Name,
			MemoryBytes: uint64(g.MemoryMiB) << 20, //nolint:gosec // validated positive
			Minor:       i,
			Nodes:       []string{filepath.Join(s.nodeDir, fmt.Sprintf("nvidia%d", i))},
			PCIBusID:    fmt.Sprintf("00000000:%02X:00.0", 0x10+i),
		})
	}
	return s
}

// Name implements Backend.
func (s *Sim) Name() string { return config.BackendSim }

// Devices implements Backend.
func (s *Sim) Devices() ([]Info, error) { return append([]Info(nil), s.devs...), nil }

// ControlNodes implements Backend.
func (s *Sim) ControlNodes() []string { return []string{filepath.Join(s.nodeDir, "nvidiactl")} }

// Topology implements Backend: the links of [sim] topology, else one host
// bridge for every pair.
func (s *Sim) Topology(a, b int) (Link, error) {
	if _, err := Find(s.devs, a); err != nil {
		return "", err
	}
	if _, err := Find(s.devs, b); err != nil {
		return "", err
	}
	if a == b {
		return LinkSame, nil
	}
	if t := s.topology; len(t) > a && len(t[a]) > b {
		return Link(t[a][b]), nil
	}
	return LinkHostBridge, nil
}

// Rank orders links from nearest (0, the same GPU) to farthest; an unknown
// link ranks farthest.
func (l Link) Rank() int {
	switch l {
	case LinkSame:
		return 0
	case LinkSingle:
		return 1
	case LinkMultiple:
		return 2
	case LinkHostBridge:
		return 3
	case LinkNode:
		return 4
	}
	return 5
}

// Close implements Backend.
func (s *Sim) Close() error { return nil }

func sortInfos(d []Info) { sort.Slice(d, func(i, j int) bool { return d[i].Index < d[j].Index }) }
