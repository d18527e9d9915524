package deviceplugin

import (
	"fmt"
	"maps"
	"slices"
	"strconv"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/mgpu-dev/mgpu/hook"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

// The memory plugin serves ACKMemory (aliyun.com/gpu-mem), one device ID
// per GiB of each GPU, for every mode of ACK that counts memory. What its
// IDs mean depends on the node's scheme:
//
//   - core_mem: they only count, as node capacity would; the container's
//     aliyun.com/gpu-core.percentage IDs choose its GPU, and its memory is
//     read from its pod's spec. Allocate answers nothing.
//   - cgpu, share, mps: they choose the GPU. A container's IDs are all of
//     one GPU (its memory is on one card), placed by the placement policy;
//     the kubelet's accounting of them is each card's free GiB.

// Environment of an mps container (NVIDIA MPS's own keys).
const (
	// EnvMPSPipe is the MPS control daemon's pipe directory.
	EnvMPSPipe = "CUDA_MPS_PIPE_DIRECTORY"
	// EnvMPSMemLimit limits the memory a client may allocate on each of
	// its devices: "<ordinal>=<limit>".
	EnvMPSMemLimit = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
	// DefaultMPSPipe is the MPS control daemon's default pipe directory.
	DefaultMPSPipe = "/tmp/nvidia-mps"
)

// mpsNotice is what the agent logs when the node enters mps mode: the
// memory limit it gives is the tenant's own environment, so the mode
// schedules memory and isolates none unless the daemon sets the limit.
const mpsNotice = "mode mps schedules memory and does not isolate it: " + EnvMPSMemLimit +
	" is the container's own environment, which it can unset or raise; a limit that holds is set in the MPS control daemon (set_default_device_pinned_mem_limit), see docs/kubernetes.md"

// cgpuCore is the core of a cgpu container's instance: the smallest
// share, a weight equal to every other cgpu container's, under the GPU's
// burst policy (EnforceMemory).
const cgpuCore = 1

// parseMemIDs parses memory IDs and groups them by GPU (k ascending).
// Unknown GPUs, k beyond the GPU's GiB, malformed and repeated IDs are
// errors.
func (p *Plugin) parseMemIDs(ids []string) (map[int][]MemID, error) {
	by := map[int][]MemID{}
	seen := map[MemID]bool{}
	for _, s := range ids {
		id, err := ParseMemID(s)
		if err != nil {
			return nil, invalid("%v", err)
		}
		gib, ok := p.memGiB[id.GPU]
		if !ok || !p.hasGPU(id.GPU) {
			return nil, invalid("device ID %q: the node has no GPU %d", s, id.GPU)
		}
		if id.K >= gib {
			return nil, invalid("device ID %q: GPU %d has %d GiB", s, id.GPU, gib)
		}
		if seen[id] {
			return nil, invalid("device ID %q given twice", s)
		}
		seen[id] = true
		by[id.GPU] = append(by[id.GPU], id)
	}
	for _, l := range by {
		slices.SortFunc(l, compareMemIDs)
	}
	return by, nil
}

// compareMemIDs orders one GPU's memory IDs by k.
func compareMemIDs(a, b MemID) int { return a.K - b.K }

// memStrings writes IDs, by GPU then k.
func memStrings(by map[int][]MemID) []string {
	var out []string
	for _, g := range slices.Sorted(maps.Keys(by)) {
		slices.SortFunc(by[g], compareMemIDs)
		for _, id := range by[g] {
			out = append(out, id.String())
		}
	}
	return out
}

// preferredMemory chooses size memory IDs among available, including
// mustInclude: under a scheme with a Core (core_mem) any, the
// must-include first; else all of one GPU, the must-include IDs' or the
// placement policy's among those with size GiB available.
func (p *Plugin) preferredMemory(available, mustInclude []string, size int) ([]string, error) {
	if size <= 0 {
		return nil, invalid("allocation size %d: must be at least 1", size)
	}
	avail, err := p.parseMemIDs(available)
	if err != nil {
		return nil, err
	}
	must, err := p.parseMemIDs(mustInclude)
	if err != nil {
		return nil, err
	}
	nMust := mergeMust(avail, must, compareMemIDs)
	if nMust > size {
		return nil, invalid("%d must-include IDs for an allocation of %d", nMust, size)
	}
	take := func(gpus []int) []string {
		out := map[int][]MemID{}
		n := 0
		for g, ids := range must {
			out[g] = slices.Clone(ids)
			n += len(ids)
		}
		for _, g := range gpus {
			for _, id := range avail[g] {
				if n == size {
					break
				}
				if !slices.Contains(out[g], id) {
					out[g] = append(out[g], id)
					n++
				}
			}
		}
		return memStrings(out)
	}
	gpus := slices.Sorted(maps.Keys(avail))
	if p.NodeScheme().Core != "" {
		return take(gpus), nil // counters: the core IDs choose the GPU
	}
	mustGPUs := slices.Sorted(maps.Keys(must))
	switch {
	case len(mustGPUs) > 1:
		return nil, invalid("%s of a container must come from one GPU; must-include IDs are of GPUs %s", p.scheme.Core, gpuList(mustGPUs))
	case len(mustGPUs) == 1:
		g := mustGPUs[0]
		if len(avail[g]) < size {
			return nil, invalid("GPU %d has %d GiB available, %d asked for (with must-include IDs of it)", g, len(avail[g]), size)
		}
		return take([]int{g}), nil
	}
	var cards []placement.Card
	for _, g := range gpus {
		cards = append(cards, placement.Card{Index: g, CoreFree: placement.WholeCore,
			MemoryMiB: uint64(p.memGiB[g]) * ACKMemory.MemoryUnitMiB, MemoryFreeMiB: uint64(len(avail[g])) * ACKMemory.MemoryUnitMiB})
	}
	chosen, err := placement.Place(cards, placement.Request{Core: 1, MemoryMiB: uint64(size) * ACKMemory.MemoryUnitMiB}, p.Policy())
	if err != nil {
		return nil, placeError(err)
	}
	return take(chosen), nil
}

// allocateMemory is Allocate for the memory plugin: nothing under a
// scheme with a Core (its plugin's answer gives the GPU); else the GPU of
// the IDs, all of one GPU, as the scheme enforces it: mgpu's CDI device
// (cgpu; the node agent tells the hook the quota), or the bare GPU (share),
// with MPS's memory limit and pipe directory (mps).
func (p *Plugin) allocateMemory(ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	if len(ids) == 0 {
		return nil, invalid("no device IDs to allocate")
	}
	by, err := p.parseMemIDs(ids)
	if err != nil {
		return nil, err
	}
	sch := p.NodeScheme()
	if sch.Core != "" {
		return &pluginapi.ContainerAllocateResponse{}, nil
	}
	gpus := slices.Sorted(maps.Keys(by))
	if len(gpus) != 1 {
		return nil, invalid("%s of a container must come from one GPU; got IDs of GPUs %s", p.scheme.Core, gpuList(gpus))
	}
	gib := len(ids)
	switch sch.Enforce {
	case EnforceMemory:
		resp := p.gpuResponse(gpus, true)
		resp.Envs[hook.EnvCore] = strconv.Itoa(cgpuCore)
		resp.Envs[hook.EnvMemory] = strconv.FormatUint(uint64(gib)*ACKMemory.MemoryUnitMiB, 10)
		return resp, nil
	case EnforceNone:
		return p.gpuResponse(gpus, false), nil
	case EnforceMPS:
		resp := p.gpuResponse(gpus, false)
		resp.Envs[EnvMPSPipe] = p.mpsPipe
		// Advisory: the tenant's process can unset or raise it
		// (mpsNotice).
		resp.Envs[EnvMPSMemLimit] = fmt.Sprintf("0=%dG", gib)
		// Read-only: a client only connects to the daemon's and the
		// server's sockets there, which a read-only mount allows; it
		// cannot unlink them or bind its own in their place, which
		// would answer every other mps container of the node.
		resp.Mounts = append(resp.Mounts, &pluginapi.Mount{ContainerPath: p.mpsPipe, HostPath: p.mpsPipe, ReadOnly: true})
		return resp, nil
	}
	return nil, invalid("the node's mode %s does not allocate %s", sch.Mode, p.scheme.Core)
}
