package device

import (
	"errors"
	"fmt"
	"os"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/mgpu-dev/mgpu/internal/config"
)

// NVML is the backend of real GPUs, through the NVIDIA driver's NVML library
// (dlopened at run time, so mgpu builds and runs without a driver).
type NVML struct {
	lib nvml.Interface
	// devRoot is where device nodes are looked up ("/dev"; tests change it).
	devRoot string
}

// OpenNVML loads libnvidia-ml.so.1 and initialises NVML.
func OpenNVML() (*NVML, error) {
	return NewNVML(nvml.New())
}

// NewNVML initialises NVML through lib (the real library or go-nvml's mock).
func NewNVML(lib nvml.Interface) (*NVML, error) {
	if ret := lib.Init(); ret != nvml.SUCCESS {
		if ret == nvml.ERROR_LIBRARY_NOT_FOUND || ret == nvml.ERROR_DRIVER_NOT_LOADED {
			return nil, ErrNoDriver
		}
		return nil, fmt.Errorf("initialise NVML: %s", nvmlErr(lib, ret))
	}
	return &NVML{lib: lib, devRoot: "/dev"}, nil
}

// Name implements Backend.
func (n *NVML) Name() string { return config.BackendNVML }

// Devices implements Backend.
func (n *NVML) Devices() ([]Info, error) {
	count, ret := n.lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("count GPUs: %s", nvmlErr(n.lib, ret))
	}
	out := make([]Info, 0, count)
	for i := 0; i < count; i++ {
		d, ret := n.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return nil, fmt.Errorf("GPU %d: get handle: %s", i, nvmlErr(n.lib, ret))
		}
		info, err := n.describe(i, d)
		if err != nil {
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		out = append(out, info)
	}
	sortInfos(out)
	return out, nil
}

func (n *NVML) describe(index int, d nvml.Device) (Info, error) {
	info := Info{Index: index}
	var ret nvml.Return
	if info.UUID, ret = d.GetUUID(); ret != nvml.SUCCESS {
		return info, fmt.Errorf("uuid: %s", nvmlErr(n.lib, ret))
	}
	if info.Name, ret = d.GetName(); ret != nvml.SUCCESS {
		return info, fmt.Errorf("name: %s", nvmlErr(n.lib, ret))
	}
	mem, ret := d.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return info, fmt.Errorf("memory: %s", nvmlErr(n.lib, ret))
	}
	info.MemoryBytes = mem.Total
	if info.Minor, ret = d.GetMinorNumber(); ret != nvml.SUCCESS {
		return info, fmt.Errorf("minor number: %s", nvmlErr(n.lib, ret))
	}
	info.Nodes = []string{fmt.Sprintf("%s/nvidia%d", n.devRoot, info.Minor)}
	if pci, ret := d.GetPciInfo(); ret == nvml.SUCCESS {
		info.PCIBusID = cString(pci.BusId[:])
	}
	return info, nil
}

// ControlNodes implements Backend.
func (n *NVML) ControlNodes() []string {
	var out []string
	for _, name := range []string{"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"} {
		p := n.devRoot + "/" + name
		if _, err := os.Stat(p); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// Topology implements Backend.
func (n *NVML) Topology(a, b int) (Link, error) {
	da, ret := n.lib.DeviceGetHandleByIndex(a)
	if ret != nvml.SUCCESS {
		return "", fmt.Errorf("GPU %d: %s", a, nvmlErr(n.lib, ret))
	}
	if a == b {
		return LinkSame, nil
	}
	db, ret := n.lib.DeviceGetHandleByIndex(b)
	if ret != nvml.SUCCESS {
		return "", fmt.Errorf("GPU %d: %s", b, nvmlErr(n.lib, ret))
	}
	level, ret := da.GetTopologyCommonAncestor(db)
	if ret != nvml.SUCCESS {
		return "", fmt.Errorf("topology of GPUs %d and %d: %s", a, b, nvmlErr(n.lib, ret))
	}
	switch level {
	case nvml.TOPOLOGY_INTERNAL:
		return LinkSame, nil
	case nvml.TOPOLOGY_SINGLE:
		return LinkSingle, nil
	case nvml.TOPOLOGY_MULTIPLE:
		return LinkMultiple, nil
	case nvml.TOPOLOGY_HOSTBRIDGE:
		return LinkHostBridge, nil
	case nvml.TOPOLOGY_NODE:
		return LinkNode, nil
	case nvml.TOPOLOGY_SYSTEM:
		return LinkSystem, nil
	default:
		return "", fmt.Errorf("topology of GPUs %d and %d: unknown level %d", a, b, level)
	}
}

// Close implements Backend.
func (n *NVML) Close() error {
	if ret := n.lib.Shutdown(); ret != nvml.SUCCESS {
		return errors.New("shut down NVML: " + nvmlErr(n.lib, ret))
	}
	return nil
}

func nvmlErr(lib nvml.Interface, ret nvml.Return) (s string) {
	defer func() {
		if recover() != nil { // mocks may not implement ErrorString
			s = fmt.Sprintf("NVML error %d", int32(ret))
		}
	}()
	return lib.ErrorString(ret)
}

func cString[T int8 | uint8](b []T) string {
	out := make([]byte, 0, len(b))
	for _, c := range b {
		if c == 0 {
			break
		}
		out = append(out, byte(c))
	}
	return string(out)
}
