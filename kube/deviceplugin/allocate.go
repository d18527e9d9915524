package deviceplugin

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/mgpu-dev/mgpu/hook"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

// Environment keys of an Allocate answer besides MGPU_CORE.
const (
	// EnvVisibleDevices tells the shim which host GPU each CUDA ordinal is.
	EnvVisibleDevices = "MGPU_VISIBLE_DEVICES"
	// EnvCUDAVisibleDevices lists the GPUs' UUIDs for the driver.
	EnvCUDAVisibleDevices = "CUDA_VISIBLE_DEVICES"
)

// errPrefix starts every error the kubelet shows a user.
const errPrefix = "mgpu-core: "

func invalid(format string, a ...any) error {
	return status.Error(codes.InvalidArgument, errPrefix+fmt.Sprintf(format, a...))
}

// checkActive refuses an allocation of an inactive plugin (the node's mode
// changed while the kubelet still had its devices).
func (p *Plugin) checkActive() error {
	if !p.Active() {
		return status.Errorf(codes.FailedPrecondition, "%s%s is not served on this node now: its %s mode is another", errPrefix, p.scheme.Core, ModeLabel)
	}
	return nil
}

// placeError turns an error of package placement into a gRPC error.
func placeError(err error) error {
	var nf *placement.NoFitError
	if errors.As(err, &nf) {
		return status.Error(codes.ResourceExhausted, errPrefix+err.Error())
	}
	return status.Error(codes.InvalidArgument, errPrefix+err.Error())
}

// parseIDs parses ids and groups them by GPU (k ascending). Unknown GPUs,
// malformed and repeated IDs are errors.
func (p *Plugin) parseIDs(ids []string) (map[int][]ID, error) {
	by := map[int][]ID{}
	seen := map[ID]bool{}
	for _, s := range ids {
		id, err := ParseID(s)
		if err != nil {
			return nil, invalid("%v", err)
		}
		if !p.hasGPU(id.GPU) {
			return nil, invalid("device ID %q: the node has no GPU %d", s, id.GPU)
		}
		if seen[id] {
			return nil, invalid("device ID %q given twice", s)
		}
		seen[id] = true
		by[id.GPU] = append(by[id.GPU], id)
	}
	for _, l := range by {
		slices.SortFunc(l, compareIDs)
	}
	return by, nil
}

// gpuList writes GPU indexes for a message: "0", "0 and 1", "0, 1 and 2".
func gpuList(gpus []int) string {
	s := make([]string, len(gpus))
	for i, g := range gpus {
		s[i] = strconv.Itoa(g)
	}
	if len(s) < 2 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
}

// countList writes how many IDs of each GPU: "100 IDs of GPU 0 and 50 of GPU 1".
func countList(by map[int][]ID) string {
	gpus := slices.Sorted(maps.Keys(by))
	s := make([]string, len(gpus))
	for i, g := range gpus {
		if i == 0 {
			s[i] = fmt.Sprintf("%d IDs of GPU %d", len(by[g]), g)
		} else {
			s[i] = fmt.Sprintf("%d of GPU %d", len(by[g]), g)
		}
	}
	if len(s) < 2 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
}

// GetPreferredAllocation implements DevicePluginServer. For each container
// it groups the available IDs by GPU, takes a GPU's count of available IDs
// as its free core, and lets placement choose with the plugin's policy.
// The kubelet tells only the mgpu-core count. With a resolver, a share is
// placed on a GPU that also has the memory the pending containers of that
// size ask for, net of what the kubelet's allocations already hold
// (placement.Place); without one, or when no GPU has it, only core is
// considered (placement.PlaceCore) and the hook's admission is the check.
func (p *Plugin) GetPreferredAllocation(ctx context.Context, r *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	if err := p.checkActive(); err != nil {
		return nil, err
	}
	out := &pluginapi.PreferredAllocationResponse{}
	for _, cr := range r.GetContainerRequests() {
		avail, must, size := cr.GetAvailableDeviceIDs(), cr.GetMustIncludeDeviceIDs(), int(cr.GetAllocationSize())
		if p.memGiB != nil {
			ids, err := p.preferredMemory(avail, must, size)
			if err != nil {
				return nil, err
			}
			out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
			continue
		}
		if p.scheme.Whole { // one ID per GPU: placed as whole GPUs of 100
			var err1, err2 error
			avail, err1 = p.scheme.expand(avail)
			must, err2 = p.scheme.expand(must)
			if err := errors.Join(err1, err2); err != nil {
				return nil, invalid("%v", err)
			}
			size *= IDsPerGPU
		}
		ids, err := p.preferred(ctx, avail, must, size)
		if err != nil {
			return nil, err
		}
		ids = p.scheme.compress(ids)
		out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return out, nil
}

// preferred chooses size IDs among available, including mustInclude.
func (p *Plugin) preferred(ctx context.Context, available, mustInclude []string, size int) ([]string, error) {
	if size <= 0 {
		return nil, invalid("allocation size %d: must be at least 1", size)
	}
	avail, err := p.parseIDs(available)
	if err != nil {
		return nil, err
	}
	must, err := p.parseIDs(mustInclude)
	if err != nil {
		return nil, err
	}
	nMust := mergeMust(avail, must, compareIDs)
	if nMust > size {
		return nil, invalid("%d must-include IDs for an allocation of %d", nMust, size)
	}
	cards := func(skip map[int][]ID) []placement.Card {
		var cs []placement.Card
		for g, ids := range avail {
			if _, ok := skip[g]; ok {
				continue
			}
			c := placement.Card{Index: g, CoreFree: len(ids)}
			if len(ids) < IDsPerGPU {
				c.Instances = 1 // some of its IDs are taken
			}
			cs = append(cs, c)
		}
		return cs
	}
	mustGPUs := slices.Sorted(maps.Keys(must))

	if size < IDsPerGPU {
		var gpu int
		switch {
		case len(mustGPUs) > 1:
			return nil, invalid("a request under %d must come from one GPU; must-include IDs are of GPUs %s", IDsPerGPU, gpuList(mustGPUs))
		case len(mustGPUs) == 1:
			gpu = mustGPUs[0]
			if len(avail[gpu]) < size {
				return nil, invalid("GPU %d has %d IDs available, %d asked for (with must-include IDs of it)", gpu, len(avail[gpu]), size)
			}
		default:
			chosen, err := p.placeShare(ctx, cards(nil), size)
			if err != nil {
				return nil, placeError(err)
			}
			gpu = chosen
		}
		ids := slices.Clone(must[gpu])
		for _, id := range avail[gpu] {
			if len(ids) == size {
				break
			}
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
		return idStrings(ids), nil
	}

	// Whole GPUs: the must-include IDs' GPUs, then the placement's.
	if size%IDsPerGPU != 0 {
		return nil, invalid("%d IDs: above %d a request must be a multiple of %d (whole GPUs)", size, IDsPerGPU, IDsPerGPU)
	}
	k := size / IDsPerGPU
	if len(mustGPUs) > k {
		return nil, invalid("must-include IDs of GPUs %s for %d whole GPUs", gpuList(mustGPUs), k)
	}
	for _, g := range mustGPUs {
		if len(avail[g]) < IDsPerGPU {
			return nil, invalid("must-include IDs of GPU %d, which has only %d of %d IDs available for a whole-GPU request", g, len(avail[g]), IDsPerGPU)
		}
	}
	gpus := slices.Clone(mustGPUs)
	switch rest := k - len(mustGPUs); {
	case p.scheme.Topology:
		// The nearest set of wholly free GPUs, the must-include ones in it.
		var free []int
		for g, ids := range avail {
			if len(ids) == IDsPerGPU {
				free = append(free, g)
			}
		}
		dist := p.dist
		if dist == nil {
			dist = func(int, int) int { return 0 }
		}
		chosen, err := placement.PlaceNear(free, mustGPUs, k, dist)
		if err != nil {
			return nil, placeError(err)
		}
		gpus = chosen
	case rest > 0:
		chosen, err := placement.PlaceCore(cards(must), rest*IDsPerGPU, p.Policy())
		if err != nil {
			return nil, placeError(err)
		}
		gpus = append(gpus, chosen...)
	}
	slices.Sort(gpus)
	var ids []ID
	for _, g := range gpus {
		ids = append(ids, gpuIDs(g)...)
	}
	return idStrings(ids), nil
}

// placeShare chooses the GPU of a share of size IDs among cards (their
// free core from the available IDs): with memory when the resolver can
// tell it (see GetPreferredAllocation), else by core alone.
func (p *Plugin) placeShare(ctx context.Context, cards []placement.Card, size int) (int, error) {
	pol := p.Policy()
	if p.resolver != nil {
		if gpu, ok := p.placeWithMemory(ctx, cards, size, pol); ok {
			return gpu, nil
		}
	}
	chosen, err := placement.PlaceCore(cards, size, pol)
	if err != nil {
		return 0, err
	}
	return chosen[0], nil
}

// placeWithMemory is placeShare's memory-aware choice; ok is false when it
// cannot be made (no pending container known, sources that do not answer,
// or no GPU with the memory).
func (p *Plugin) placeWithMemory(ctx context.Context, cards []placement.Card, size int, pol placement.Policy) (int, bool) {
	ctx, cancel := context.WithTimeout(ctx, cardsTimeout)
	defer cancel()
	com, err := p.resolver.pendingMemory(ctx, size)
	if err != nil {
		p.log.Warn("preferred allocation by core alone: the pending containers are not known", "err", err)
		return 0, false
	}
	if !com.known {
		p.log.Warn("preferred allocation by core alone: no pod of this node waits for this size", "size", size)
		return 0, false
	}
	live, _ := p.src.Cards(ctx) // GPUs that do not answer are left out
	byIndex := map[int]placement.Card{}
	for _, c := range live {
		byIndex[c.Index] = c
	}
	var withMem []placement.Card
	for _, c := range cards {
		l, ok := byIndex[c.Index]
		if !ok {
			continue
		}
		c.MemoryMiB = l.MemoryMiB
		free := l.MemoryFreeMiB
		switch held := com.committed[c.Index]; {
		case held == wholeCard || held >= l.MemoryMiB:
			free = 0
		default:
			free = min(free, l.MemoryMiB-held)
		}
		c.MemoryFreeMiB = free
		withMem = append(withMem, c)
	}
	chosen, err := placement.Place(withMem, placement.Request{Core: size, MemoryMiB: com.pending}, pol)
	if err != nil {
		p.log.Warn("preferred allocation by core alone", "err", err)
		return 0, false
	}
	p.log.Debug("preferred allocation", "size", size, "memory_mib", com.pending, "gpu", chosen[0])
	return chosen[0], true
}

// mergeMust adds the must-include IDs to the available ones (by GPU,
// sorted by cmp): the kubelet lists them among the available ones, and
// they are taken as available whether it does or not. It returns how many
// there are.
func mergeMust[T comparable](avail, must map[int][]T, cmp func(a, b T) int) int {
	n := 0
	for g, ids := range must {
		for _, id := range ids {
			if !slices.Contains(avail[g], id) {
				avail[g] = append(avail[g], id)
			}
		}
		slices.SortFunc(avail[g], cmp)
		n += len(ids)
	}
	return n
}

func idStrings(ids []ID) []string {
	slices.SortFunc(ids, compareIDs)
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

// Allocate implements DevicePluginServer. The kubelet checkpoints the
// answer and replays it on restarts without asking again, so it is made
// from the IDs alone: fewer than 100 IDs of one GPU are a share of that
// GPU, whole sets of 100 are whole GPUs. Each GPU is named as its CDI
// device (kind=index) and MGPU_CORE carries the share's core.
func (p *Plugin) Allocate(_ context.Context, r *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	if err := p.checkActive(); err != nil {
		return nil, err
	}
	out := &pluginapi.AllocateResponse{}
	for _, cr := range r.GetContainerRequests() {
		allocate := p.allocate
		if p.memGiB != nil {
			allocate = p.allocateMemory
		}
		resp, err := allocate(cr.GetDevicesIds())
		if err != nil {
			return nil, err
		}
		out.ContainerResponses = append(out.ContainerResponses, resp)
	}
	return out, nil
}

func (p *Plugin) allocate(ids []string) (*pluginapi.ContainerAllocateResponse, error) {
	if len(ids) == 0 {
		return nil, invalid("no device IDs to allocate")
	}
	ids, err := p.scheme.expand(ids)
	if err != nil {
		return nil, invalid("%v", err)
	}
	by, err := p.parseIDs(ids)
	if err != nil {
		return nil, err
	}
	gpus := slices.Sorted(maps.Keys(by))
	core := len(ids)
	if len(ids) < IDsPerGPU {
		if len(gpus) > 1 {
			return nil, invalid("a request under %d must come from one GPU; got IDs of GPUs %s", IDsPerGPU, gpuList(gpus))
		}
	} else {
		for _, g := range gpus {
			if len(by[g]) != IDsPerGPU {
				return nil, invalid("a request of %d must be whole GPUs (all %d IDs of each); got %s", len(ids), IDsPerGPU, countList(by))
			}
		}
		core = IDsPerGPU
	}
	resp := p.gpuResponse(gpus, true)
	resp.Envs[hook.EnvCore] = strconv.Itoa(core)
	return resp, nil
}

// gpuResponse is the answer that gives a container GPUs gpus (ascending):
// their CDI devices (cdi), else their device nodes and the control nodes
// (a bare GPU, without mgpu's hook and shim).
func (p *Plugin) gpuResponse(gpus []int, cdi bool) *pluginapi.ContainerAllocateResponse {
	// The container's CUDA ordinal k is its k-th GPU by index, as the
	// driver numbers the devices a container sees: the shim maps ordinals
	// to host GPUs (MGPU_VISIBLE_DEVICES), and the driver (or fakecuda)
	// shows just those GPUs (CUDA_VISIBLE_DEVICES, by UUID where known).
	host := make([]string, len(gpus))
	uuids := make([]string, 0, len(gpus))
	for i, g := range gpus {
		host[i] = strconv.Itoa(g)
		if u, ok := p.uuids[g]; ok {
			uuids = append(uuids, u)
		}
	}
	resp := &pluginapi.ContainerAllocateResponse{Envs: map[string]string{}}
	if len(uuids) == len(gpus) {
		resp.Envs[EnvCUDAVisibleDevices] = strings.Join(uuids, ",")
	}
	if !cdi {
		for _, g := range gpus {
			for _, n := range p.bareNodes[g] {
				resp.Devices = append(resp.Devices, deviceSpec(n))
			}
		}
		for _, n := range p.bareControl {
			resp.Devices = append(resp.Devices, deviceSpec(n))
		}
		return resp
	}
	resp.Envs[EnvVisibleDevices] = strings.Join(host, ",")
	for _, g := range gpus {
		resp.CdiDevices = append(resp.CdiDevices, &pluginapi.CDIDevice{Name: fmt.Sprintf("%s=%d", p.cdiKind, g)})
	}
	return resp
}

// deviceSpec is a device node of the host at /dev/<its name> in the
// container.
func deviceSpec(host string) *pluginapi.DeviceSpec {
	return &pluginapi.DeviceSpec{ContainerPath: "/dev/" + filepath.Base(host), HostPath: host, Permissions: "rw"}
}
