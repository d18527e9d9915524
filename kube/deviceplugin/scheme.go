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
//
// A Whole scheme (ACK's default mode) has one device ID per GPU, each a
// whole GPU with all its memory, and no memory resource. Inside, its IDs
// stand for the 100 of their GPU (expand), so that placement, Allocate and
// the resolver treat them as any whole-GPU request.
type Scheme struct {
	// Mode is the value of ModeLabel that selects the scheme.
	Mode string
	// Core is the device-plugin resource (percent of a GPU; with Whole,
	// whole GPUs).
	Core corev1.ResourceName
	// Memory is the node capacity (GPU memory of all GPUs, in units);
	// empty for a Whole scheme.
	Memory corev1.ResourceName
	// MemoryUnitMiB is the MiB in one unit of Memory.
	MemoryUnitMiB uint64
	// Socket is the plugin's socket in the device-plugin directory.
	Socket string
	// Whole: one device ID per GPU, each a whole GPU.
	Whole bool
	// Topology: a Whole scheme whose GPUs are chosen nearest each other
	// (placement.PlaceNear), not by the placement policy.
	Topology bool
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
	// SchemeDefault is ACK's default mode: exclusive whole GPUs as
	// nvidia.com/gpu, the resource of NVIDIA's own device plugin (which
	// must then not run on the node).
	SchemeDefault = Scheme{Mode: "default", Core: "nvidia.com/gpu", Socket: "mgpu-ack-default.sock", Whole: true}
	// SchemeTopology is ACK's topology-aware mode: whole GPUs as
	// aliyun.com/gpu, a container's GPUs the nearest set free.
	SchemeTopology = Scheme{Mode: "topology", Core: "aliyun.com/gpu", Socket: "mgpu-ack-topology.sock", Whole: true, Topology: true}
)

// Schemes lists every scheme the node agent serves, each through its own
// plugin; the inactive ones advertise no devices and no memory.
var Schemes = []Scheme{SchemeMGPU, SchemeCoreMem, SchemeDefault, SchemeTopology}

// unsupportedModes are ACK's other values of ModeLabel, which this version
// does not serve.
var unsupportedModes = []string{"cgpu", "share", "mps"}

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
	return strings.Join(names[:len(names)-1], ", ") + " and " + names[len(names)-1]
}

// MemoryUnits is the capacity of Memory for GPUs of these sizes: each
// GPU's MiB in whole units (rounded down: never more than a card has),
// summed.
func (s Scheme) MemoryUnits(gpuMiB []uint64) uint64 {
	if s.Memory == "" {
		return 0
	}
	var n uint64
	for _, m := range gpuMiB {
		n += m / s.MemoryUnitMiB
	}
	return n
}

// kubeletIDs are the device IDs the kubelet sees of GPU gpu: its 100, or
// with Whole one, k 00.
func (s Scheme) kubeletIDs(gpu int) []ID {
	if s.Whole {
		return []ID{{GPU: gpu}}
	}
	return gpuIDs(gpu)
}

// expand turns the kubelet's IDs of a Whole scheme into the 100 IDs of
// each of their GPUs; other schemes' IDs are returned as they are. An ID
// that is not a whole GPU's is an error.
func (s Scheme) expand(ids []string) ([]string, error) {
	if !s.Whole {
		return ids, nil
	}
	out := make([]string, 0, len(ids)*IDsPerGPU)
	for _, v := range ids {
		id, err := ParseID(v)
		if err != nil || id.K != 0 {
			return nil, fmt.Errorf("%q is not a device ID of %s (want mgpu-<gpu>-00, one per GPU)", v, s.Core)
		}
		for _, e := range gpuIDs(id.GPU) {
			out = append(out, e.String())
		}
	}
	return out, nil
}

// compress is expand's inverse for a Whole scheme: the GPUs of ids, one
// ID each.
func (s Scheme) compress(ids []string) []string {
	if !s.Whole {
		return ids
	}
	seen := map[int]bool{}
	var out []ID
	for _, v := range ids {
		if id, err := ParseID(v); err == nil && !seen[id.GPU] {
			seen[id.GPU] = true
			out = append(out, ID{GPU: id.GPU})
		}
	}
	return idStrings(out)
}
