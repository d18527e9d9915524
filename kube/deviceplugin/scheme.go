package deviceplugin

import (
	"fmt"
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
	// MemoryIDs: Memory is a device-plugin resource of one ID per unit of
	// each GPU (MemID), served by the memory plugin (ACKMemory), not node
	// capacity. With a Core, its IDs only count (the core IDs choose the
	// GPU); without one (Core ""), they choose the GPU.
	MemoryIDs bool
	// Enforce is what mgpu enforces of a container of the scheme.
	Enforce Enforcement
}

// Enforcement is what mgpu enforces of a scheme's containers.
type Enforcement int

const (
	// EnforceQuotas is an mgpu instance of the requested core and memory
	// under the pod's policy.
	EnforceQuotas Enforcement = iota
	// EnforceMemory (ACK's cgpu) is an mgpu instance of the requested
	// memory and core 1 under the GPU's own policy, which must be a burst
	// policy: containers with demand share the GPU equally and a lone one
	// takes all of it.
	EnforceMemory
	// EnforceNone (ACK's share) is the GPU without mgpu's hook or shim; the
	// memory request only schedules.
	EnforceNone
	// EnforceMPS (ACK's mps) is the GPU without mgpu's hook or shim, the
	// memory quota given to NVIDIA MPS as CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
	// in the container's environment: advisory, as the tenant can change
	// it, so the request schedules and the MPS control daemon's own limit,
	// if the operator sets one, is what holds.
	EnforceMPS
	// EnforceDRA is mgpu's DRA driver (package dra): the scheduler places
	// ResourceClaims on the GPUs, and a container's instance is its
	// claim's share; no device-plugin resource lists anything.
	EnforceDRA
)

// Bare reports whether the scheme's containers get the GPU without mgpu's
// hook and shim (no instance).
func (e Enforcement) Bare() bool { return e == EnforceNone || e == EnforceMPS }

// Resources are the device-plugin resources of the scheme: its Core, and
// its Memory with MemoryIDs.
func (s Scheme) Resources() []corev1.ResourceName {
	var out []corev1.ResourceName
	if s.Core != "" {
		out = append(out, s.Core)
	}
	if s.MemoryIDs {
		out = append(out, s.Memory)
	}
	return out
}

// The schemes mgpu serves.
var (
	// SchemeMGPU is Volcengine's: vke.volcengine.com/mgpu-core and
	// vke.volcengine.com/mgpu-memory (MiB). ModeLabel value "mgpu"
	// (mgpu's own; ACK has no such value).
	SchemeMGPU = Scheme{Mode: "mgpu", Core: ResourceName, Memory: MemoryResourceName, MemoryUnitMiB: 1, Socket: SocketName}
	// SchemeCoreMem is ACK's core_mem: aliyun.com/gpu-core.percentage and
	// aliyun.com/gpu-mem (GiB), both isolated.
	SchemeCoreMem = Scheme{Mode: "core_mem", Core: "aliyun.com/gpu-core.percentage", Memory: ACKMemory.Core, MemoryUnitMiB: 1024, Socket: "mgpu-ack-core.sock", MemoryIDs: true}
	// SchemeDefault is ACK's default mode: exclusive whole GPUs as
	// nvidia.com/gpu, the resource of NVIDIA's own device plugin (which
	// must then not run on the node).
	SchemeDefault = Scheme{Mode: "default", Core: "nvidia.com/gpu", Socket: "mgpu-ack-default.sock", Whole: true}
	// SchemeTopology is ACK's topology-aware mode: whole GPUs as
	// aliyun.com/gpu, a container's GPUs the nearest set free.
	SchemeTopology = Scheme{Mode: "topology", Core: "aliyun.com/gpu", Socket: "mgpu-ack-topology.sock", Whole: true, Topology: true}
	// SchemeCGPU is ACK's cgpu: aliyun.com/gpu-mem (GiB) alone, memory
	// isolated, compute shared (EnforceMemory).
	SchemeCGPU = Scheme{Mode: "cgpu", Memory: ACKMemory.Core, MemoryUnitMiB: 1024, MemoryIDs: true, Enforce: EnforceMemory}
	// SchemeShare is ACK's share: aliyun.com/gpu-mem schedules, nothing
	// is enforced (EnforceNone).
	SchemeShare = Scheme{Mode: "share", Memory: ACKMemory.Core, MemoryUnitMiB: 1024, MemoryIDs: true, Enforce: EnforceNone}
	// SchemeMPS is ACK's mps: aliyun.com/gpu-mem, the memory limit given
	// to NVIDIA MPS (EnforceMPS, advisory); real GPUs with an MPS control
	// daemon only.
	SchemeMPS = Scheme{Mode: "mps", Memory: ACKMemory.Core, MemoryUnitMiB: 1024, MemoryIDs: true, Enforce: EnforceMPS}
	// SchemeDRA is mgpu's own mode "dra": the GPUs are the DRA driver's
	// (gpu.mgpu.io), placed by the scheduler per GPU; the device plugins
	// list nothing and the memory capacities are 0.
	SchemeDRA = Scheme{Mode: "dra", Enforce: EnforceDRA}

	// ACKMemory is not a mode: it is the resource of the memory plugin,
	// aliyun.com/gpu-mem in GiB, one device ID per GiB of each GPU, which
	// every mode of ACK that counts memory (core_mem, cgpu, share, mps)
	// serves through it (MemoryIDs).
	ACKMemory = Scheme{Core: "aliyun.com/gpu-mem", MemoryUnitMiB: 1024, Socket: "mgpu-ack-mem.sock"}
)

// Schemes lists every scheme the node agent serves, each through its own
// plugin; the inactive ones advertise no devices and no memory.
var Schemes = []Scheme{SchemeMGPU, SchemeCoreMem, SchemeDefault, SchemeTopology, SchemeCGPU, SchemeShare, SchemeMPS, SchemeDRA}

// PluginSchemes are the plugins the node agent runs, one per device-plugin
// resource: each scheme's Core, and the memory plugin (ACKMemory).
func PluginSchemes() []Scheme {
	var out []Scheme
	for _, s := range Schemes {
		if s.Core != "" {
			out = append(out, s)
		}
	}
	return append(out, ACKMemory)
}

// ParseMode returns the scheme of a ModeLabel value ("" is not a value:
// the caller falls back to its default).
func ParseMode(v string) (Scheme, error) {
	for _, s := range Schemes {
		if v == s.Mode {
			return s, nil
		}
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
	if s.Memory == "" || s.MemoryUnitMiB == 0 {
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
