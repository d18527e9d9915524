package deviceplugin

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// ModeLabel is the node label of Alibaba ACK that chooses a node's GPU
// scheduling mode, and so which resources it advertises.
const ModeLabel = "ack.node.gpu.schedule"

// A Scheme is the set of resources one scheduling mode advertises: a
// device-plugin resource of compute (percent of one GPU, 100 device IDs
// per GPU, multiples of 100 for whole GPUs) and a node-capacity resource
// of memory in units of MemoryUnitMiB. The quotas mean the same under
// every scheme; only the names and the memory unit differ.
type Scheme struct {
	// Mode is the value of ModeLabel that selects the scheme.
	Mode string
	// Core is the device-plugin resource (percent of a GPU).
	Core corev1.ResourceName
	// Memory is the node capacity (GPU memory of all GPUs, in units).
	Memory corev1.ResourceName
	// MemoryUnitMiB is the MiB in one unit of Memory.
	MemoryUnitMiB uint64
	// Socket is the plugin's socket in the device-plugin directory.
	Socket string
}

// The schemes mgpu serves.
var (
	// SchemeMGPU is Volcengine's: vke.volcengine.com/mgpu-core and
	// vke.volcengine.com/mgpu-memory (MiB). ModeLabel value "mgpu"
	// (mgpu's own; ACK has no such value).
	SchemeMGPU = Scheme{Mode: "mgpu", Core: ResourceName, Memory: MemoryResourceName, MemoryUnitMiB: 1, Socket: SocketName}
	// SchemeCoreMem is ACK's core_mem: aliyun.com/gpu-core.percentage and
	// aliyun.com/gpu-mem (GiB), both isolated.
	SchemeCoreMem = Scheme{Mode: "core_mem", Core: "aliyun.com/gpu-core.percentage", Memory: "aliyun.com/gpu-mem", MemoryUnitMiB: 1024, Socket: "mgpu-ack-core.sock"}
)

// Schemes lists every scheme the node agent serves, each through its own
// plugin; the inactive ones advertise no devices and no memory.
var Schemes = []Scheme{SchemeMGPU, SchemeCoreMem}

// unsupportedModes are ACK's other values of ModeLabel, which this version
// does not serve.
var unsupportedModes = []string{"default", "cgpu", "share", "mps", "topology"}

// ParseMode returns the scheme of a ModeLabel value ("" is not a value:
// the caller falls back to its default).
func ParseMode(v string) (Scheme, error) {
	for _, s := range Schemes {
		if v == s.Mode {
			return s, nil
		}
	}
	if slices.Contains(unsupportedModes, v) {
		return Scheme{}, fmt.Errorf("%s=%s is not supported by this version of mgpu (it serves %s)", ModeLabel, v, modeNames())
	}
	return Scheme{}, fmt.Errorf("%s=%q is not a mode (mgpu serves %s)", ModeLabel, v, modeNames())
}

func modeNames() string {
	names := make([]string, len(Schemes))
	for i, s := range Schemes {
		names[i] = s.Mode
	}
	return strings.Join(names, " and ")
}

// MemoryUnits is the capacity of Memory for GPUs of these sizes: each
// GPU's MiB in whole units (rounded down: never more than a card has),
// summed.
func (s Scheme) MemoryUnits(gpuMiB []uint64) uint64 {
	var n uint64
	for _, m := range gpuMiB {
		n += m / s.MemoryUnitMiB
	}
	return n
}
