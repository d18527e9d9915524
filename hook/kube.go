package hook

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/mgpu-dev/mgpu/enforcer/api"
	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
)

// The annotations containerd's CRI puts into a pod container's OCI spec.
const (
	AnnotationSandboxNamespace = "io.kubernetes.cri.sandbox-namespace"
	AnnotationSandboxName      = "io.kubernetes.cri.sandbox-name"
	AnnotationSandboxUID       = "io.kubernetes.cri.sandbox-uid"
	AnnotationContainerName    = "io.kubernetes.cri.container-name"
)

// Agent is the node agent's query the hook uses; *agentapi.Client
// implements it.
type Agent interface {
	Assignment(ctx context.Context, c agentapi.Container) (agentapi.Assignment, error)
}

// WithAgent replaces the node agent's client (tests).
func WithAgent(a Agent) Option { return func(h *Hook) { h.agent = a } }

// PodContainer reads which pod container a spec is from its CRI
// annotations; ok is false for a container no CRI made (ctr, podman,
// Docker). Some of the annotations without the others are an error.
func PodContainer(annotations map[string]string) (c agentapi.Container, ok bool, err error) {
	keys := []string{AnnotationSandboxNamespace, AnnotationSandboxName, AnnotationSandboxUID, AnnotationContainerName}
	vals := make([]string, len(keys))
	var missing []string
	for i, k := range keys {
		vals[i] = annotations[k]
		if vals[i] == "" {
			missing = append(missing, k)
		}
	}
	if len(missing) == len(keys) {
		return agentapi.Container{}, false, nil
	}
	if len(missing) > 0 {
		return agentapi.Container{}, false, fmt.Errorf("the container has CRI annotations but not %s; mgpu cannot tell which pod it is", strings.Join(missing, ", "))
	}
	return agentapi.Container{Namespace: vals[0], Pod: vals[1], UID: vals[2], Container: vals[3]}, true, nil
}

// podRequests are the instance requests of a pod's container, one per
// device: its assignment from the node agent, which reads the pod's own
// spec and the kubelet's allocation. Whatever the container's environment
// or annotations say of mgpu keys is not used, and the devices the CDI
// spec gave it must be exactly those the kubelet allocated.
func (h *Hook) podRequests(ctx context.Context, c agentapi.Container, devs []Device, base api.CreateRequest) ([]api.CreateRequest, error) {
	a, err := h.agent.Assignment(ctx, c)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", c, err)
	}
	have := make([]int, len(devs))
	for i, d := range devs {
		have[i] = d.Index
	}
	want := make([]int, len(a.GPUs))
	for i, g := range a.GPUs {
		want[i] = g.Index
	}
	slices.Sort(want)
	if !slices.Equal(have, want) {
		return nil, fmt.Errorf("%s has the mgpu devices of GPUs %v, and the kubelet allocated it GPUs %v; request GPUs only through %s", c, have, want, AnnotationCore)
	}
	pol, err := policy.Parse(a.Policy)
	if err != nil {
		return nil, fmt.Errorf("%s: the node agent answered policy %q", c, a.Policy)
	}
	if a.Class != "" {
		if _, err := policy.ParseClass(a.Class); err != nil {
			return nil, fmt.Errorf("%s: the node agent answered class %q", c, a.Class)
		}
	}
	out := make([]api.CreateRequest, len(devs))
	for i, d := range devs {
		g := a.GPUs[slices.IndexFunc(a.GPUs, func(g agentapi.GPU) bool { return g.Index == d.Index })]
		if g.Core < MinCore || g.Core > MaxCore || g.MemoryMiB > MaxMemoryMiB {
			return nil, fmt.Errorf("%s: the node agent answered core %d and %d MiB on GPU %d", c, g.Core, g.MemoryMiB, g.Index)
		}
		r := base
		r.Policy, r.Core, r.MemoryMiB, r.Class = pol.String(), g.Core, g.MemoryMiB, a.Class
		if g.Claim != "" && r.Pod != nil {
			p := *r.Pod // base's is every GPU's
			p.Claim = g.Claim
			r.Pod = &p
		}
		out[i] = r
	}
	return out, nil
}
