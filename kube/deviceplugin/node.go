package deviceplugin

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/mgpu-dev/mgpu/kube/allocview"
	"github.com/mgpu-dev/mgpu/kube/placement"
)

// PlacementLabel is the node label that chooses the placement policy of
// preferred allocations (binpack, spread); absent, the --placement flag's.
const PlacementLabel = "ack.node.gpu.placement"

// DefaultPublishInterval is how often the node's labels and capacity are
// checked and set again (the kubelet may reset capacity on a restart).
const DefaultPublishInterval = 30 * time.Second

// NodePublisher keeps the node object as mgpu describes it: its labels
// (card model, policy, vke.node.gpu.schedule=mgpu) and the memory capacity
// of the node's scheme (vke.volcengine.com/mgpu-memory in MiB, or
// aliyun.com/gpu-mem in GiB), the other schemes' at 0. It follows the
// node's placement label, and its mode label (ModeLabel): the plugin of
// the mode's scheme lists the devices, the others none.
//
// A mode change waits until no container holds device IDs of the current
// scheme (the kubelet's allocations): a running pod keeps the resources,
// quotas and answers it was admitted with. Draining the node's GPU pods
// applies it.
type NodePublisher struct {
	client   kubernetes.Interface
	node     string
	labels   map[string]string
	gpuMiB   []uint64
	plugins  []*Plugin
	fallback placement.Policy
	log      *slog.Logger

	modes      bool // WithModes was given
	resolver   *Resolver
	allocs     AllocationSource
	defaultSch Scheme
	current    *Scheme // nil until the first publish decides
	deferred   string  // the mode whose change was last said to wait
	refused    string  // the label value last said to be unsupported

	dra     DRAPool                              // nil: no DRA driver
	collect func(context.Context) allocview.Node // nil: no allocation annotation
	check   func(Scheme) error                   // nil: every mode suits the node
}

// allocRefresh is the age after which the allocation annotation is written
// again even when nothing changed, so that readers can tell a live agent
// from a stale annotation (mgpu-cli inspect --cluster notes one older than
// 5 minutes).
const allocRefresh = time.Minute

// WithAllocation makes the publisher keep the node's annotation
// allocview.Annotation: what collect reads of the node's enforcers, written
// when it differs from the annotation's, or when that is older than
// allocRefresh.
func (n *NodePublisher) WithAllocation(collect func(context.Context) allocview.Node) *NodePublisher {
	n.collect = collect
	return n
}

// NewNodePublisher returns the publisher of node: labels to set, the
// memory of each GPU (MiB), and the plugins (one per scheme) whose
// placement follows the node's label (fallback when it has none).
func NewNodePublisher(client kubernetes.Interface, node string, labels map[string]string, gpuMiB []uint64, plugins []*Plugin, fallback placement.Policy, log *slog.Logger) *NodePublisher {
	return &NodePublisher{client: client, node: node, labels: maps.Clone(labels), gpuMiB: slices.Clone(gpuMiB),
		plugins: slices.Clone(plugins), fallback: fallback, log: log, defaultSch: SchemeMGPU}
}

// WithModes makes the publisher follow the node's mode label: def is the
// scheme of a node without the label, r the resolver to switch with it,
// allocs the kubelet's allocations that hold a change back. Without it
// the node serves the first plugin's scheme.
func (n *NodePublisher) WithModes(def Scheme, r *Resolver, allocs AllocationSource) *NodePublisher {
	n.modes, n.defaultSch, n.resolver, n.allocs = true, def, r, allocs
	return n
}

// DRAPool is the DRA driver as the mode follows it (*dra.Driver).
type DRAPool interface {
	// Prepared is the number of claims the node prepared: while any is,
	// the mode stays dra.
	Prepared() int
	// SetActive publishes the GPUs (true) or an empty pool.
	SetActive(bool)
}

// WithDRA makes the publisher switch the DRA driver with the mode: its
// pool lists the GPUs in mode dra only, and a change from dra waits until
// no claim is prepared.
func (n *NodePublisher) WithDRA(d DRAPool) *NodePublisher {
	n.dra = d
	return n
}

// Current is the scheme the node serves (nil before the first publish).
func (n *NodePublisher) Current() *Scheme { return n.current }

// Run publishes at once and every interval until ctx ends; failures are
// logged and tried again.
func (n *NodePublisher) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if err := n.Publish(ctx); err != nil && ctx.Err() == nil {
			n.log.Warn("publishing the node's labels and capacity; trying again", "node", n.node, "err", err, "in", interval)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Publish sets what differs: the mode, labels, then the status's
// capacity; and the plugins' placement from the node's label.
func (n *NodePublisher) Publish(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	node, err := n.client.CoreV1().Nodes().Get(ctx, n.node, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("node %s: %w", n.node, err)
	}

	pol := n.fallback
	if v, ok := node.Labels[PlacementLabel]; ok {
		p, err := placement.ParsePolicy(v)
		if err != nil {
			n.log.Warn("the node's placement label is not valid; using the default", "label", PlacementLabel, "value", v, "default", n.fallback.String())
		} else {
			pol = p
		}
	}
	for _, p := range n.plugins {
		if pol != p.Policy() {
			n.log.Info("placement", "policy", pol.String(), "resource", p.Scheme().Core)
			p.SetPolicy(pol)
		}
	}

	if err := n.applyMode(ctx, node.Labels); err != nil {
		return err
	}

	change := map[string]string{}
	for _, k := range slices.Sorted(maps.Keys(n.labels)) {
		if node.Labels[k] != n.labels[k] {
			change[k] = n.labels[k]
		}
	}
	if len(change) > 0 {
		patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": change}})
		if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.node, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			return fmt.Errorf("node %s: labels: %w", n.node, err)
		}
		n.log.Info("node labels set", "node", n.node, "labels", change)
	}

	capacity := map[string]string{}
	for _, s := range Schemes {
		if s.Memory == "" || s.MemoryIDs {
			continue // a Whole scheme's memory goes with its GPUs; the memory plugin's is the kubelet's to set
		}
		want := "0"
		if n.current != nil && s.Mode == n.current.Mode {
			want = strconv.FormatUint(s.MemoryUnits(n.gpuMiB), 10)
		}
		if q, ok := node.Status.Capacity[s.Memory]; !ok || q.String() != want {
			capacity[string(s.Memory)] = want
		}
	}
	if len(capacity) > 0 {
		patch, _ := json.Marshal(map[string]any{"status": map[string]any{"capacity": capacity}})
		if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.node, types.MergePatchType, patch, metav1.PatchOptions{}, "status"); err != nil {
			return fmt.Errorf("node %s: capacity: %w", n.node, err)
		}
		n.log.Info("node capacity set", "node", n.node, "capacity", capacity)
	}
	return n.publishAllocation(ctx, node.Annotations[allocview.Annotation])
}

// publishAllocation writes the allocation annotation when it is needed.
func (n *NodePublisher) publishAllocation(ctx context.Context, old string) error {
	if n.collect == nil {
		return nil
	}
	view := n.collect(ctx)
	if was, err := allocview.Decode(old); err == nil && slices.Equal(was.GPUs, view.GPUs) && view.Updated.Sub(was.Updated) < allocRefresh {
		return nil
	}
	enc, err := allocview.Encode(view)
	if err != nil {
		return fmt.Errorf("node %s: allocation: %w", n.node, err)
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"annotations": map[string]string{allocview.Annotation: enc}}})
	if _, err := n.client.CoreV1().Nodes().Patch(ctx, n.node, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("node %s: annotation %s: %w", n.node, allocview.Annotation, err)
	}
	n.log.Debug("allocation published", "node", n.node, "gpus", len(view.GPUs))
	return nil
}

// AddBare adds to view what the kubelet's allocations give containers of
// a bare scheme (share, mps), which are no enforcer's instances: each
// container's aliyun.com/gpu-mem on its GPU, as one more instance (a GPU
// whose enforcer does not answer shows none, as for instances).
func AddBare(ctx context.Context, allocs AllocationSource, view *allocview.Node) error {
	as, err := allocs.Allocations(ctx)
	if err != nil {
		return err
	}
	for _, a := range as {
		if a.Resource != ACKMemory.Core {
			continue
		}
		per := map[int]uint64{}
		for _, s := range a.IDs {
			if id, err := ParseMemID(s); err == nil {
				per[id.GPU] += ACKMemory.MemoryUnitMiB
			}
		}
		for i := range view.GPUs {
			g := &view.GPUs[i]
			if mib, ok := per[g.Index]; ok && g.Running {
				g.AllocatedMiB += mib
				g.Instances++
			}
		}
	}
	return nil
}

// heldScheme is the scheme whose device-plugin resources are the held
// ones: want if its resources include them all, else the first scheme
// whose resources are exactly them, else the first whose resources
// include them, else the first holding any (containers of two modes). ok
// is false when nothing is held.
func heldScheme(held map[corev1.ResourceName]int, want Scheme) (Scheme, bool) {
	if len(held) == 0 {
		return want, false
	}
	covers := func(s Scheme) bool {
		for r := range held {
			if !slices.Contains(s.Resources(), r) {
				return false
			}
		}
		return true
	}
	if covers(want) {
		return want, true
	}
	for _, s := range Schemes {
		if covers(s) && len(s.Resources()) == len(held) {
			return s, true
		}
	}
	for _, s := range Schemes {
		if covers(s) {
			return s, true
		}
	}
	for _, s := range Schemes {
		for _, r := range s.Resources() {
			if held[r] > 0 {
				return s, true
			}
		}
	}
	return want, true
}

// WithModeCheck makes the publisher refuse a mode label whose scheme
// check finds wrong for this node (its GPUs' policies, MPS), as one that
// is not served: logged once, the mode kept.
func (n *NodePublisher) WithModeCheck(check func(Scheme) error) *NodePublisher {
	n.check = check
	return n
}

// applyMode works out the node's scheme from its mode label and switches
// to it when no container holds device IDs of the current one.
func (n *NodePublisher) applyMode(ctx context.Context, labels map[string]string) error {
	if !n.modes {
		if n.current == nil && len(n.plugins) > 0 {
			s := n.plugins[0].Scheme()
			n.current = &s
		}
		return nil
	}
	want := n.defaultSch
	if v, ok := labels[ModeLabel]; ok {
		s, err := ParseMode(v)
		if err == nil && n.check != nil {
			err = n.check(s)
		}
		switch {
		case err != nil && n.current != nil:
			if n.refused != v {
				n.log.Warn("the node's mode label is not served; keeping the mode", "err", err, "mode", n.current.Mode)
				n.refused = v
			}
			want = *n.current
		case err != nil:
			if n.refused != v {
				n.log.Warn("the node's mode label is not served; using the default", "err", err, "mode", n.defaultSch.Mode)
				n.refused = v
			}
		default:
			want = s
			n.refused = ""
		}
	}
	if n.current != nil && want.Mode == n.current.Mode {
		n.deferred = ""
		return nil
	}
	allocs, err := n.allocs.Allocations(ctx)
	if err != nil {
		return fmt.Errorf("node %s: mode %s: the kubelet's allocations: %w", n.node, want.Mode, err)
	}
	held := map[corev1.ResourceName]int{}
	for _, a := range allocs {
		if len(a.IDs) > 0 {
			held[a.Resource]++
		}
	}
	prepared := 0
	if n.dra != nil {
		prepared = n.dra.Prepared()
	}
	if n.current == nil {
		// At start: the scheme that containers hold is the node's,
		// whatever the label says now.
		if prepared > 0 && want.Mode != SchemeDRA.Mode {
			n.log.Warn("DRA claims are prepared on the node and the label's mode is another; keeping dra until they are released", "claims", prepared, "label", want.Mode)
			want = SchemeDRA
		} else if s, ok := heldScheme(held, want); ok && s.Mode != want.Mode {
			n.log.Warn("containers hold device IDs of another mode than the label's; keeping it until they are gone", "mode", s.Mode, "label", want.Mode, "resources", s.Resources())
			want = s
		}
	} else {
		k := 0
		for _, r := range n.current.Resources() {
			k += held[r]
		}
		what := "containers"
		if n.current.Enforce == EnforceDRA {
			k, what = prepared, "claims"
		}
		if k > 0 {
			if n.deferred != want.Mode {
				n.log.Warn("mode change waits until no container holds the current mode's device IDs or DRA claims (drain the node's GPU pods)",
					"from", n.current.Mode, "to", want.Mode, what, k, "resources", n.current.Resources())
				n.deferred = want.Mode
			}
			return nil
		}
	}
	for _, p := range n.plugins {
		p.SetMode(want)
	}
	if n.resolver != nil {
		n.resolver.SetScheme(want)
	}
	if n.dra != nil {
		n.dra.SetActive(want.Enforce == EnforceDRA)
	}
	from := "none"
	if n.current != nil {
		from = n.current.Mode
	}
	n.current, n.deferred = &want, ""
	n.log.Info("mode", "from", from, "to", want.Mode, "core", want.Core, "memory", want.Memory)
	if want.Enforce == EnforceMPS {
		n.log.Warn(mpsNotice)
	}
	return nil
}
