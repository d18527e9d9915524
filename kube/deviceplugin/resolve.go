package deviceplugin

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/mgpu-dev/mgpu/hook"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
	"github.com/mgpu-dev/mgpu/kube/dra"
)

// MemoryResourceName is the node capacity the plugin publishes (MiB of GPU
// memory, all GPUs together) and a container requests beside mgpu-core.
const MemoryResourceName = "vke.volcengine.com/mgpu-memory"

// PolicyKey is the pod annotation of a pod's compute policy and the node
// label of the policy a node runs.
const PolicyKey = hook.AnnotationPolicy

// DefaultPolicy is a pod's policy when it has no annotation.
const DefaultPolicy = policy.FixedShare

// PodSource reads pods from the API server.
type PodSource interface {
	// Pod returns one pod, fresh from the API server.
	Pod(ctx context.Context, namespace, name string) (*corev1.Pod, error)
	// NodePods returns the pods bound to the node.
	NodePods(ctx context.Context) ([]corev1.Pod, error)
}

// Allocation is the device IDs of one resource (a Scheme's Core) the
// kubelet allocated to one container (the PodResources API).
type Allocation struct {
	Namespace, Pod, Container string
	Resource                  corev1.ResourceName
	IDs                       []string
}

// AllocationSource reads the kubelet's allocations.
type AllocationSource interface {
	Allocations(ctx context.Context) ([]Allocation, error)
}

// ContainerRequest is one container's mgpu requests in its pod's spec.
type ContainerRequest struct {
	Core      int    // 0: none
	MemoryMiB uint64 // 0: none
}

// RequestOf reads a container's mgpu requests under SchemeMGPU.
func RequestOf(c *corev1.Container) (ContainerRequest, error) { return SchemeMGPU.RequestOf(c) }

// RequestOf reads a container's requests of the scheme's resources: its
// limits, else its requests (the API server makes them equal for extended
// resources), memory converted to MiB. Values that are not whole numbers,
// core outside 1..100 and not a multiple of 100, memory without core and
// fractional core without memory are errors; the admission webhook refuses
// such pods, and the agent does not rely on it having run.
func (s Scheme) RequestOf(c *corev1.Container) (ContainerRequest, error) {
	get := func(name corev1.ResourceName) (resource.Quantity, bool) {
		if q, ok := c.Resources.Limits[name]; ok {
			return q, true
		}
		q, ok := c.Resources.Requests[name]
		return q, ok
	}
	var r ContainerRequest
	if s.Core == "" { // memory alone (cgpu, share, mps)
		if q, ok := get(s.Memory); ok {
			v, whole := q.AsInt64()
			maxUnits := hook.MaxMemoryMiB / s.MemoryUnitMiB
			if !whole || v < 1 || uint64(v) > maxUnits {
				return r, fmt.Errorf("%s %s is not a whole number of %s from 1 to %d", s.Memory, q.String(), s.unitName(), maxUnits)
			}
			r.MemoryMiB = uint64(v) * s.MemoryUnitMiB
		}
		return r, nil
	}
	if s.Whole {
		if q, ok := get(s.Core); ok {
			v, whole := q.AsInt64()
			if !whole || v < 1 || v > maxWholeGPUs {
				return r, fmt.Errorf("%s %s is not a whole number of GPUs from 1 to %d", s.Core, q.String(), maxWholeGPUs)
			}
			r.Core = int(v) * IDsPerGPU // whole GPUs with all their memory
		}
		return r, nil
	}
	if q, ok := get(s.Core); ok {
		v, whole := q.AsInt64()
		if !whole || v < 1 || (v > IDsPerGPU && v%IDsPerGPU != 0) {
			return r, fmt.Errorf("%s %s is not 1 to 100 or a multiple of 100", s.Core, q.String())
		}
		r.Core = int(v)
	}
	if q, ok := get(s.Memory); ok {
		v, whole := q.AsInt64()
		maxUnits := hook.MaxMemoryMiB / s.MemoryUnitMiB
		if !whole || v < 1 || uint64(v) > maxUnits {
			return r, fmt.Errorf("%s %s is not a whole number of %s from 1 to %d", s.Memory, q.String(), s.unitName(), maxUnits)
		}
		r.MemoryMiB = uint64(v) * s.MemoryUnitMiB
	}
	switch {
	case r.MemoryMiB > 0 && r.Core == 0:
		return r, fmt.Errorf("%s needs %s", s.Memory, s.Core)
	case r.Core > 0 && r.Core < IDsPerGPU && r.MemoryMiB == 0:
		return r, fmt.Errorf("%s %d (a share of one GPU) needs %s", s.Core, r.Core, s.Memory)
	}
	return r, nil
}

// maxWholeGPUs bounds a Whole scheme's request (no node has more GPUs).
const maxWholeGPUs = 1024

// unitName is the name of the scheme's memory unit.
func (s Scheme) unitName() string {
	switch s.MemoryUnitMiB {
	case 1:
		return "MiB"
	case 1024:
		return "GiB"
	}
	return fmt.Sprintf("%d MiB", s.MemoryUnitMiB)
}

// PolicyOf is a pod's compute policy: its annotation, else fixed-share.
func PolicyOf(pod *corev1.Pod) (policy.Policy, error) {
	v, ok := pod.Annotations[PolicyKey]
	if !ok {
		return DefaultPolicy, nil
	}
	p, err := policy.Parse(v)
	if err != nil {
		return 0, fmt.Errorf("annotation %s: %w", PolicyKey, err)
	}
	return p, nil
}

// ClassKey is the pod annotation of a pod's priority class.
const ClassKey = hook.AnnotationClass

// ClassOf is a pod's priority class: its annotation, else "" (online).
func ClassOf(pod *corev1.Pod) (string, error) {
	v, ok := pod.Annotations[ClassKey]
	if !ok {
		return "", nil
	}
	if _, err := policy.ParseClass(v); err != nil {
		return "", fmt.Errorf("annotation %s: %w", ClassKey, err)
	}
	return v, nil
}

// findContainer returns the spec of a pod's container (or init container).
func findContainer(pod *corev1.Pod, name string) *corev1.Container {
	for _, l := range [][]corev1.Container{pod.Spec.Containers, pod.Spec.InitContainers} {
		for i := range l {
			if l[i].Name == name {
				return &l[i]
			}
		}
	}
	return nil
}

// Resolver answers which quota a container of this node has, under the
// node's scheme (SchemeMGPU until SetScheme).
type Resolver struct {
	node   string
	gpus   []int
	pods   PodSource
	allocs AllocationSource
	scheme atomic.Pointer[Scheme]
	gpuPol map[int]policy.Policy // each GPU's policy (EnforceMemory's, EnforceDRA's)
	claims ClaimSource           // the DRA driver's prepared claims (EnforceDRA)
}

// ClaimSource is what the DRA driver prepared (*dra.Driver).
type ClaimSource interface {
	// Claim is the prepared claim namespace/name, preferably the one
	// reserved for the pod of UID pod.
	Claim(namespace, name, pod string) (dra.Claim, bool)
}

// SetClaims tells the resolver the DRA driver's claims, which answer
// under SchemeDRA. Call it before serving.
func (r *Resolver) SetClaims(c ClaimSource) { r.claims = c }

// SetGPUPolicies tells the resolver the compute policy of each GPU (the
// node config's), which a cgpu container's instance runs under. Call it
// before serving.
func (r *Resolver) SetGPUPolicies(p map[int]policy.Policy) { r.gpuPol = maps.Clone(p) }

// NewResolver returns the resolver of node, whose GPUs are gpus.
func NewResolver(node string, gpus []int, pods PodSource, allocs AllocationSource) *Resolver {
	r := &Resolver{node: node, gpus: slices.Clone(gpus), pods: pods, allocs: allocs}
	r.SetScheme(SchemeMGPU)
	return r
}

// SetScheme changes the resources the resolver reads (the node's mode
// changed).
func (r *Resolver) SetScheme(s Scheme) { r.scheme.Store(&s) }

// Scheme is the scheme the resolver reads.
func (r *Resolver) Scheme() Scheme { return *r.scheme.Load() }

// idsOf returns the IDs of resource the kubelet allocated to a container.
func idsOf(allocs []Allocation, resource corev1.ResourceName, ns, pod, ctr string) []string {
	var ids []string
	for _, a := range allocs {
		if a.Resource == resource && a.Namespace == ns && a.Pod == pod && a.Container == ctr {
			ids = append(ids, a.IDs...)
		}
	}
	return ids
}

// refuse is an answer that names the container.
func refuse(c agentapi.Container, format string, a ...any) error {
	return fmt.Errorf("%s: %s", c, fmt.Sprintf(format, a...))
}

// Resolve returns what container c may have: the requests of its pod's
// spec (fresh from the API server, checked to be the pod of c's sandbox by
// UID and to be bound to this node) on exactly the GPUs the kubelet
// allocated to it (PodResources), checked against each other.
func (r *Resolver) Resolve(ctx context.Context, c agentapi.Container) (agentapi.Assignment, error) {
	if c.Namespace == "" || c.Pod == "" || c.UID == "" || c.Container == "" {
		return agentapi.Assignment{}, fmt.Errorf("a query needs namespace, pod, uid and container; got %+v", c)
	}
	pod, err := r.pods.Pod(ctx, c.Namespace, c.Pod)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "reading the pod from the API server: %v", err)
	}
	if string(pod.UID) != c.UID {
		return agentapi.Assignment{}, refuse(c, "the pod of that name is UID %s, not the container's sandbox's %s (deleted and created again?)", pod.UID, c.UID)
	}
	if pod.Spec.NodeName != r.node {
		return agentapi.Assignment{}, refuse(c, "the pod is bound to node %q, not this node %q", pod.Spec.NodeName, r.node)
	}
	spec := findContainer(pod, c.Container)
	if spec == nil {
		return agentapi.Assignment{}, refuse(c, "the pod has no such container")
	}
	sch := r.Scheme()
	if sch.Enforce == EnforceDRA {
		return r.resolveDRA(c, pod, spec)
	}
	req, err := sch.RequestOf(spec)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "%v", err)
	}
	if sch.Core == "" {
		return r.resolveMemory(ctx, c, pod, sch, req)
	}
	if req.Core == 0 {
		return agentapi.Assignment{}, refuse(c, "it has an mgpu device but requests no %s (the node's %s is %s); request the GPU through the resource, not the CDI device", sch.Core, ModeLabel, sch.Mode)
	}
	pol, err := PolicyOf(pod)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "%v", err)
	}
	class, err := ClassOf(pod)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "%v", err)
	}

	allocs, err := r.allocs.Allocations(ctx)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "reading the kubelet's allocations: %v", err)
	}
	ids, err := sch.expand(idsOf(allocs, sch.Core, c.Namespace, c.Pod, c.Container))
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "the kubelet allocated %v", err)
	}
	if len(ids) != req.Core {
		return agentapi.Assignment{}, refuse(c, "it requests %s %d, and the kubelet allocated %d of its device IDs", sch.Core, req.Core, len(ids))
	}
	by, err := perGPU(r.gpus, ids, ParseID, func(id ID) int { return id.GPU })
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "%v", err)
	}
	gpus := slices.Sorted(maps.Keys(by))
	out := agentapi.Assignment{Container: c, Policy: pol.String(), Class: class}
	if req.Core < IDsPerGPU {
		if len(gpus) != 1 {
			return agentapi.Assignment{}, refuse(c, "%s %d must come from one GPU; the kubelet allocated IDs of %d GPUs", sch.Core, req.Core, len(gpus))
		}
		out.GPUs = []agentapi.GPU{{Index: gpus[0], Core: req.Core, MemoryMiB: req.MemoryMiB}}
		return out, nil
	}
	n := uint64(len(gpus))
	if req.MemoryMiB > 0 && req.MemoryMiB < n {
		return agentapi.Assignment{}, refuse(c, "%s of %d MiB across %d GPUs is under 1 MiB each", sch.Memory, req.MemoryMiB, n)
	}
	for _, g := range gpus {
		if by[g] != IDsPerGPU {
			return agentapi.Assignment{}, refuse(c, "%s %d is whole GPUs, and the kubelet allocated %d IDs of GPU %d", sch.Core, req.Core, by[g], g)
		}
		// A whole-GPU request's memory is the container's across its
		// GPUs, split evenly; none means each whole card.
		out.GPUs = append(out.GPUs, agentapi.GPU{Index: g, Core: IDsPerGPU, MemoryMiB: req.MemoryMiB / n})
	}
	return out, nil
}

// perGPU counts the kubelet's allocated IDs by GPU (gpuOf); an ID that
// does not parse, is of a GPU not in gpus, or comes twice is an error.
func perGPU[T comparable](gpus []int, ids []string, parse func(string) (T, error), gpuOf func(T) int) (map[int]int, error) {
	by := map[int]int{}
	seen := map[T]bool{}
	for _, s := range ids {
		id, err := parse(s)
		if err != nil {
			return nil, fmt.Errorf("the kubelet allocated %w", err)
		}
		if !slices.Contains(gpus, gpuOf(id)) || seen[id] {
			return nil, fmt.Errorf("the kubelet allocated device ID %s, which this node does not serve (or twice)", s)
		}
		seen[id] = true
		by[gpuOf(id)]++
	}
	return by, nil
}

// commitment is what the kubelet's allocations hold of each GPU's memory,
// from the allocated pods' specs, and the memory of the containers that
// wait for an allocation of a given size.
type commitment struct {
	committed map[int]uint64 // MiB per GPU; wholeCard for a whole card
	pending   uint64         // the largest memory of a pending container of the size
	known     bool           // pending found at least one container
}

// wholeCard marks a GPU held whole, whatever its memory.
const wholeCard = ^uint64(0)

// pendingMemory works out, for a preferred allocation of size IDs, the
// memory the container being admitted asks for and what the kubelet's
// allocations already hold per GPU. The kubelet does not say which
// container it admits: the candidates are the containers of this node's
// pods that request size and have no allocation yet; the largest of their
// memories is planned for. Whichever is admitted, the hook then checks the
// container's own request against its GPU's enforcer, which refuses more
// than the GPU has free.
func (r *Resolver) pendingMemory(ctx context.Context, size int) (commitment, error) {
	pods, err := r.pods.NodePods(ctx)
	if err != nil {
		return commitment{}, err
	}
	allocs, err := r.allocs.Allocations(ctx)
	if err != nil {
		return commitment{}, err
	}
	type key struct{ ns, pod, ctr string }
	byPod := map[[2]string]*corev1.Pod{}
	for i := range pods {
		byPod[[2]string{pods[i].Namespace, pods[i].Name}] = &pods[i]
	}
	sch := r.Scheme()
	out := commitment{committed: map[int]uint64{}}
	allocated := map[key]bool{}
	for _, a := range allocs {
		if len(a.IDs) == 0 || a.Resource != sch.Core {
			continue
		}
		allocated[key{a.Namespace, a.Pod, a.Container}] = true
		pod := byPod[[2]string{a.Namespace, a.Pod}]
		var spec *corev1.Container
		if pod != nil {
			spec = findContainer(pod, a.Container)
		}
		per := map[int]int{}
		all, _ := sch.expand(a.IDs) // IDs of no whole GPU count for none
		for _, s := range all {
			if id, err := ParseID(s); err == nil {
				per[id.GPU]++
			}
		}
		req := ContainerRequest{}
		if spec != nil {
			req, _ = sch.RequestOf(spec)
		}
		for g := range per {
			switch {
			case req.Core >= IDsPerGPU && req.MemoryMiB == 0, spec == nil:
				// A whole card, or a pod the API no longer shows:
				// plan as if it held the card.
				out.committed[g] = wholeCard
			case out.committed[g] != wholeCard:
				out.committed[g] += req.MemoryMiB / uint64(len(per))
			}
		}
	}
	for i := range pods {
		pod := &pods[i]
		if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed || pod.DeletionTimestamp != nil {
			continue
		}
		for _, l := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
			for j := range l {
				req, err := sch.RequestOf(&l[j])
				if err != nil || req.Core != size || allocated[key{pod.Namespace, pod.Name, l[j].Name}] {
					continue
				}
				out.known = true
				out.pending = max(out.pending, req.MemoryMiB)
			}
		}
	}
	return out, nil
}

// resolveMemory is Resolve under a scheme of memory alone: cgpu's
// instance of the requested memory and core cgpuCore under its GPU's
// policy, on the GPU of the kubelet's aliyun.com/gpu-mem IDs. The bare
// schemes (share, mps) give no mgpu device, so a container with one is
// refused.
func (r *Resolver) resolveMemory(ctx context.Context, c agentapi.Container, pod *corev1.Pod, sch Scheme, req ContainerRequest) (agentapi.Assignment, error) {
	if sch.Enforce != EnforceMemory {
		return agentapi.Assignment{}, refuse(c, "it has an mgpu device, and the node's %s is %s, whose containers get the GPU without mgpu; request it through %s", ModeLabel, sch.Mode, sch.Memory)
	}
	if req.MemoryMiB == 0 {
		return agentapi.Assignment{}, refuse(c, "it has an mgpu device but requests no %s (the node's %s is %s); request the GPU through the resource, not the CDI device", sch.Memory, ModeLabel, sch.Mode)
	}
	allocs, err := r.allocs.Allocations(ctx)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "reading the kubelet's allocations: %v", err)
	}
	ids := idsOf(allocs, sch.Memory, c.Namespace, c.Pod, c.Container)
	gib := req.MemoryMiB / sch.MemoryUnitMiB
	if uint64(len(ids)) != gib {
		return agentapi.Assignment{}, refuse(c, "it requests %s %d, and the kubelet allocated %d of its device IDs", sch.Memory, gib, len(ids))
	}
	gpus, err := perGPU(r.gpus, ids, ParseMemID, func(id MemID) int { return id.GPU })
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "%v", err)
	}
	if len(gpus) != 1 {
		return agentapi.Assignment{}, refuse(c, "%s %d must come from one GPU; the kubelet allocated IDs of %d GPUs", sch.Memory, gib, len(gpus))
	}
	g := slices.Collect(maps.Keys(gpus))[0]
	pol, ok := r.gpuPol[g]
	if !ok {
		return agentapi.Assignment{}, refuse(c, "the compute policy of GPU %d is not known", g)
	}
	if v, ok := pod.Annotations[PolicyKey]; ok && v != pol.String() {
		return agentapi.Assignment{}, refuse(c, "annotation %s is %q; under %s=%s a container runs under its GPU's policy, %s (remove the annotation)", PolicyKey, v, ModeLabel, sch.Mode, pol)
	}
	class, err := ClassOf(pod)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "%v", err)
	}
	return agentapi.Assignment{Container: c, Policy: pol.String(), Class: class, GPUs: []agentapi.GPU{{Index: g, Core: cgpuCore, MemoryMiB: req.MemoryMiB}}}, nil
}
