// Package dra is mgpu's Dynamic Resource Allocation driver, run by the node
// agent on nodes whose mode (ack.node.gpu.schedule) is dra. It publishes
// one ResourceSlice device per GPU that many claims may share
// (allowMultipleAllocations), with consumable capacities cores (percent),
// memory (MiB granularity) and instances (the GPU's max_instances), so
// that the scheduler itself fits each claim to one GPU's remaining
// capacity. The kubelet then asks the driver to prepare the claim: the
// driver reserves exactly the claim's consumedCapacity on that GPU, keyed
// by claim UID and shareID, in a checkpoint that outlives the agent and
// the kubelet, and returns the GPU's CDI device. mgpu-hook admits the
// container against that reservation through the node agent (package
// deviceplugin's Resolver), after checking that the container's sandbox
// is a pod the claim is reserved for.
package dra

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strconv"
	"sync"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/dranames"
)

// The driver's names (package dranames, which the webhook and mgpu-cli
// use without this package's dependencies).
const (
	DriverName      = dranames.Driver
	DeviceClassName = dranames.DeviceClass

	CapCores     = dranames.CapCores
	CapMemory    = dranames.CapMemory
	CapInstances = dranames.CapInstances

	AttrIndex     = dranames.AttrIndex
	AttrUUID      = dranames.AttrUUID
	AttrModel     = dranames.AttrModel
	AttrMemoryMiB = dranames.AttrMemoryMiB
	AttrPolicy    = dranames.AttrPolicy
	AttrSwitch    = dranames.AttrSwitch

	TaintEnforcerDown = dranames.TaintEnforcerDown
)

// GPU is one GPU the driver publishes.
type GPU struct {
	Index        int
	UUID         string
	Model        string
	MemoryMiB    uint64
	Policy       policy.Policy
	Switch       int // online_offline_switch
	MaxInstances int
}

// DeviceName is the ResourceSlice device of GPU index.
func DeviceName(index int) string { return dranames.DeviceName(index) }

// Config is what New needs.
type Config struct {
	// Node is the node's name, also the pool's.
	Node string
	// CDIKind is the CDI kind of mgpu's per-GPU devices (vendor/class).
	CDIKind string
	// GPUs of the node.
	GPUs []GPU
	// DataDir is the driver's directory (the kubelet's
	// plugins/gpu.mgpu.io), where its socket and checkpoint are.
	DataDir string
	Log     *slog.Logger
}

// Driver is the DRA driver of one node.
type Driver struct {
	node, cdiKind, path string
	gpus                map[int]GPU
	order               []int
	log                 *slog.Logger

	mu        sync.Mutex
	claims    map[string]Claim // prepared, by claim UID
	active    bool             // the node's mode is dra
	unhealthy map[int]bool
	publish   func(resourceslice.DriverResources) error // nil until Run started the helper
}

// New returns the driver, with the claims its checkpoint holds prepared.
func New(cfg Config) (*Driver, error) {
	if cfg.Node == "" || cfg.CDIKind == "" || cfg.DataDir == "" || cfg.Log == nil {
		return nil, errors.New("dra.New: node, CDI kind, data directory and logger are required")
	}
	d := &Driver{node: cfg.Node, cdiKind: cfg.CDIKind, path: filepath.Join(cfg.DataDir, CheckpointName),
		gpus: map[int]GPU{}, log: cfg.Log, unhealthy: map[int]bool{}}
	for _, g := range cfg.GPUs {
		if _, dup := d.gpus[g.Index]; dup {
			return nil, fmt.Errorf("dra.New: GPU %d twice", g.Index)
		}
		d.gpus[g.Index] = g
		d.order = append(d.order, g.Index)
	}
	slices.Sort(d.order)
	claims, err := loadCheckpoint(d.path, DriverName)
	if err != nil {
		return nil, err
	}
	d.claims = claims
	if len(claims) > 0 {
		d.log.Info("DRA claims restored from the checkpoint", "claims", len(claims), "path", d.path)
	}
	return d, nil
}

// Resources is what the driver publishes: the node's pool, with one
// device per GPU while the node's mode is dra, else empty (the driver is
// up and the node serves the device plugins).
func (d *Driver) Resources() resourceslice.DriverResources {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.resources()
}

func (d *Driver) resources() resourceslice.DriverResources {
	var devs []resourceapi.Device
	if d.active {
		for _, i := range d.order {
			devs = append(devs, d.device(d.gpus[i]))
		}
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		d.node: {Slices: []resourceslice.Slice{{Devices: devs}}},
	}}
}

// device is GPU g's ResourceSlice device.
func (d *Driver) device(g GPU) resourceapi.Device {
	mem := resource.MustParse(strconv.FormatUint(g.MemoryMiB, 10) + "Mi")
	inst := resource.MustParse(strconv.Itoa(g.MaxInstances))
	one := resource.MustParse("1")
	hundred := resource.MustParse("100")
	mi := resource.MustParse("1Mi")
	dev := resourceapi.Device{
		Name:                     DeviceName(g.Index),
		AllowMultipleAllocations: ptr.To(true),
		Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			AttrIndex:     {IntValue: ptr.To(int64(g.Index))},
			AttrUUID:      {StringValue: ptr.To(g.UUID)},
			AttrModel:     {StringValue: ptr.To(g.Model)},
			AttrMemoryMiB: {IntValue: ptr.To(int64(g.MemoryMiB))},
			AttrPolicy:    {StringValue: ptr.To(g.Policy.String())},
			AttrSwitch:    {IntValue: ptr.To(int64(g.Switch))},
		},
		Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{
			// A request without cores or memory takes all of it: a
			// claim of nothing is the whole GPU, as nvidia.com/gpu.
			CapCores: {Value: hundred, RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:    ptr.To(hundred.DeepCopy()),
				ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: ptr.To(one.DeepCopy()), Max: ptr.To(hundred.DeepCopy()), Step: ptr.To(one.DeepCopy())},
			}},
			CapMemory: {Value: mem, RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:    ptr.To(mem.DeepCopy()),
				ValidRange: &resourceapi.CapacityRequestPolicyRange{Min: ptr.To(mi.DeepCopy()), Max: ptr.To(mem.DeepCopy()), Step: ptr.To(mi.DeepCopy())},
			}},
			// Each share is one instance of the GPU's enforcer.
			CapInstances: {Value: inst, RequestPolicy: &resourceapi.CapacityRequestPolicy{
				Default:     ptr.To(one.DeepCopy()),
				ValidValues: []resource.Quantity{one.DeepCopy()},
			}},
		},
	}
	if d.unhealthy[g.Index] {
		dev.Taints = []resourceapi.DeviceTaint{{Key: TaintEnforcerDown, Effect: resourceapi.DeviceTaintEffectNoSchedule}}
	}
	return dev
}

// SetActive publishes the GPUs (true: the node's mode is dra) or an empty
// pool (false).
func (d *Driver) SetActive(active bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.active == active {
		return
	}
	d.active = active
	d.log.Info("DRA pool", "gpus", map[bool]string{true: "published", false: "empty"}[active])
	d.republish()
}

// SetHealth records which GPUs' enforcers answer; a GPU that does not is
// published with the taint TaintEnforcerDown.
func (d *Driver) SetHealth(healthy map[int]bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	changed := false
	for _, i := range d.order {
		down := !healthy[i]
		if d.unhealthy[i] != down {
			changed = true
			d.unhealthy[i] = down
			if down {
				d.log.Warn("GPU tainted for DRA: its enforcer does not answer", "gpu", i, "taint", TaintEnforcerDown)
			} else {
				d.log.Info("GPU untainted for DRA: its enforcer answers", "gpu", i)
			}
		}
	}
	if changed {
		d.republish()
	}
}

// republish hands the resources to the helper, if it runs. d.mu is held.
func (d *Driver) republish() {
	if d.publish == nil {
		return
	}
	if err := d.publish(d.resources()); err != nil {
		d.log.Error("publishing the DRA ResourceSlice", "err", err)
	}
}

// Prepared is the number of claims the node has prepared.
func (d *Driver) Prepared() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.claims)
}

// Claim returns the prepared claim namespace/name: the one reserved for
// the pod of UID pod when there are two (a claim deleted and made again
// under its name before the kubelet unprepared the first).
func (d *Driver) Claim(namespace, name, pod string) (Claim, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	var found Claim
	ok := false
	for _, uid := range sortedKeys(d.claims) {
		c := d.claims[uid]
		if c.Namespace != namespace || c.Name != name {
			continue
		}
		if c.ReservedFor(pod) {
			return c, true
		}
		found, ok = c, true
	}
	return found, ok
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: each claim's
// shares of this node's GPUs are checked and reserved, and its CDI
// devices returned. A claim prepared before (the kubelet or the agent
// restarted, or another pod of the claim starts) answers the same, its
// pods brought up to date. Reservations are checkpointed before the
// answer.
func (d *Driver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	next := make(map[string]Claim, len(d.claims)+len(claims))
	for k, v := range d.claims {
		next[k] = v
	}
	for _, rc := range claims {
		c, err := d.prepare(rc, next)
		if err != nil {
			d.log.Warn("DRA claim refused", "claim", rc.Namespace+"/"+rc.Name, "uid", rc.UID, "err", err)
			out[rc.UID] = kubeletplugin.PrepareResult{Err: err}
			continue
		}
		next[c.UID] = c
		out[rc.UID] = kubeletplugin.PrepareResult{Devices: d.resultDevices(c)}
	}
	if err := saveCheckpoint(d.path, DriverName, next); err != nil {
		return nil, err
	}
	for uid, c := range next {
		if _, had := d.claims[uid]; !had {
			d.log.Info("DRA claim prepared", "claim", c.Namespace+"/"+c.Name, "uid", uid, "shares", c.Shares, "pods", c.Pods)
		}
	}
	d.claims = next
	return out, nil
}

// prepare checks one claim against the node and what others hold
// (claims, without this one) and returns its record.
func (d *Driver) prepare(rc *resourceapi.ResourceClaim, claims map[string]Claim) (Claim, error) {
	if rc.Status.Allocation == nil {
		return Claim{}, fmt.Errorf("claim %s/%s is not allocated", rc.Namespace, rc.Name)
	}
	c := Claim{UID: string(rc.UID), Namespace: rc.Namespace, Name: rc.Name}
	for _, r := range rc.Status.ReservedFor {
		if r.Resource == "pods" && r.APIGroup == "" {
			c.Pods = append(c.Pods, string(r.UID))
		}
	}
	slices.Sort(c.Pods)
	seen := map[int]bool{}
	for _, r := range rc.Status.Allocation.Devices.Results {
		if r.Driver != DriverName {
			continue
		}
		s, err := d.share(r)
		if err != nil {
			return Claim{}, fmt.Errorf("claim %s/%s, request %q: %w", rc.Namespace, rc.Name, r.Request, err)
		}
		if seen[s.GPU] {
			return Claim{}, fmt.Errorf("claim %s/%s holds two shares of GPU %d (device %s); mgpu gives a container one share per GPU: make the claim's requests one, or select distinct devices", rc.Namespace, rc.Name, s.GPU, s.Device)
		}
		seen[s.GPU] = true
		c.Shares = append(c.Shares, s)
	}
	if len(c.Shares) == 0 {
		return Claim{}, fmt.Errorf("claim %s/%s has no device of driver %s", rc.Namespace, rc.Name, DriverName)
	}
	if old, ok := claims[c.UID]; ok {
		// Prepared before: the allocation of a claim never changes.
		if !slices.Equal(old.Shares, c.Shares) {
			return Claim{}, fmt.Errorf("claim %s/%s was prepared with shares %v and is now allocated %v", rc.Namespace, rc.Name, old.Shares, c.Shares)
		}
		return c, nil
	}
	if !d.active {
		return Claim{}, fmt.Errorf("this node's mode (ack.node.gpu.schedule) is not dra: its GPUs are served by the device plugins")
	}
	for _, s := range c.Shares {
		if err := d.fits(s, claims); err != nil {
			return Claim{}, fmt.Errorf("claim %s/%s: %w", rc.Namespace, rc.Name, err)
		}
	}
	return c, nil
}

// share reads one allocation result of this driver.
func (d *Driver) share(r resourceapi.DeviceRequestAllocationResult) (Share, error) {
	if r.Pool != d.node {
		return Share{}, fmt.Errorf("device %s is of pool %q, not this node's %q", r.Device, r.Pool, d.node)
	}
	i, ok := dranames.ParseDeviceName(r.Device)
	if !ok {
		return Share{}, fmt.Errorf("device %q is not one of this node's GPUs", r.Device)
	}
	g, ok := d.gpus[i]
	if !ok {
		return Share{}, fmt.Errorf("device %s: this node has no GPU %d", r.Device, i)
	}
	if r.AdminAccess != nil && *r.AdminAccess {
		return Share{}, fmt.Errorf("device %s: adminAccess is not served (a share needs its quota)", r.Device)
	}
	s := Share{Request: r.Request, Device: r.Device, GPU: i}
	if r.ShareID != nil {
		s.ShareID = string(*r.ShareID)
	}
	cores, ok := r.ConsumedCapacity[CapCores]
	if !ok {
		return Share{}, fmt.Errorf("device %s: the allocation records no consumed %s (is the DRAConsumableCapacity feature of the scheduler on?)", r.Device, CapCores)
	}
	v, whole := cores.AsInt64()
	if !whole || v < 1 || v > 100 {
		return Share{}, fmt.Errorf("device %s: consumed %s %s is not a whole number from 1 to 100", r.Device, CapCores, cores.String())
	}
	s.Core = int(v)
	mem, ok := r.ConsumedCapacity[CapMemory]
	if !ok {
		return Share{}, fmt.Errorf("device %s: the allocation records no consumed %s", r.Device, CapMemory)
	}
	b, whole := mem.AsInt64()
	if !whole || b < 1<<20 || b%(1<<20) != 0 || uint64(b>>20) > g.MemoryMiB {
		return Share{}, fmt.Errorf("device %s: consumed %s %s is not a whole number of MiB from 1Mi to %dMi", r.Device, CapMemory, mem.String(), g.MemoryMiB)
	}
	s.MemoryMiB = uint64(b >> 20)
	return s, nil
}

// fits checks that share s, beside every other prepared share of its GPU,
// stays within the GPU's cores, memory and instances: the scheduler
// placed it so, and the driver is the last to check.
func (d *Driver) fits(s Share, claims map[string]Claim) error {
	g := d.gpus[s.GPU]
	core, mib, n := s.Core, s.MemoryMiB, 1
	for _, c := range claims {
		for _, o := range c.Shares {
			if o.GPU == s.GPU {
				core += o.Core
				mib += o.MemoryMiB
				n++
			}
		}
	}
	switch {
	case core > 100:
		return fmt.Errorf("GPU %d would hold %d%% of cores with this share of %d%%, over 100 (the scheduler's allocation disagrees with what this node prepared)", s.GPU, core, s.Core)
	case mib > g.MemoryMiB:
		return fmt.Errorf("GPU %d would hold %d MiB with this share of %d MiB, over its %d MiB (the scheduler's allocation disagrees with what this node prepared)", s.GPU, mib, s.MemoryMiB, g.MemoryMiB)
	case n > g.MaxInstances:
		return fmt.Errorf("GPU %d would hold %d shares, over its max_instances %d", s.GPU, n, g.MaxInstances)
	}
	return nil
}

// resultDevices are the kubelet's devices of a prepared claim: each share
// with its GPU's CDI device.
func (d *Driver) resultDevices(c Claim) []kubeletplugin.Device {
	out := make([]kubeletplugin.Device, 0, len(c.Shares))
	for _, s := range c.Shares {
		dev := kubeletplugin.Device{
			Requests:     []string{s.Request},
			PoolName:     d.node,
			DeviceName:   s.Device,
			CDIDeviceIDs: []string{d.cdiKind + "=" + strconv.Itoa(s.GPU)},
		}
		if s.ShareID != "" {
			dev.ShareID = ptr.To(types.UID(s.ShareID))
		}
		out = append(out, dev)
	}
	return out
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: the claims'
// reservations are released (a claim not prepared is no error).
func (d *Driver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[types.UID]error, len(claims))
	next := make(map[string]Claim, len(d.claims))
	for k, v := range d.claims {
		next[k] = v
	}
	var gone []Claim
	for _, c := range claims {
		out[c.UID] = nil
		if old, ok := next[string(c.UID)]; ok {
			gone = append(gone, old)
			delete(next, string(c.UID))
		}
	}
	if len(gone) == 0 {
		return out, nil
	}
	if err := saveCheckpoint(d.path, DriverName, next); err != nil {
		return nil, err
	}
	d.claims = next
	for _, c := range gone {
		d.log.Info("DRA claim released", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "shares", c.Shares)
	}
	return out, nil
}

// HandleError implements kubeletplugin.DRAPlugin: background errors (the
// ResourceSlice's publication) are logged; the helper retries them.
func (d *Driver) HandleError(_ context.Context, err error, msg string) {
	d.log.Error("DRA: "+msg, "err", err)
}

// WatchHealthStatus implements kubeletplugin.DRAPlugin: a GPU whose
// enforcer is down is tainted in the ResourceSlice instead.
func (d *Driver) WatchHealthStatus(context.Context, chan<- kubeletplugin.DeviceHealthReport) error {
	return kubeletplugin.ErrHealthNotSupported
}
