package deviceplugin

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/mgpu-dev/mgpu/internal/policy"
	"github.com/mgpu-dev/mgpu/kube/agentapi"
	"github.com/mgpu-dev/mgpu/kube/dra"
)

// resolveDRA is Resolve under SchemeDRA: the container's instances are the
// shares of the ResourceClaims it names (resources.claims) that mgpu's DRA
// driver prepared on this node, each claim reserved for the container's
// pod alone and used by no other of its containers, under its GPUs'
// policy. The kubelet's CDI devices of those claims are the GPUs' mgpu
// devices, which the hook checks against the answer.
func (r *Resolver) resolveDRA(c agentapi.Container, pod *corev1.Pod, spec *corev1.Container) (agentapi.Assignment, error) {
	if r.claims == nil {
		return agentapi.Assignment{}, refuse(c, "the node's %s is %s and the DRA driver is not running", ModeLabel, SchemeDRA.Mode)
	}
	var gpus []agentapi.GPU
	for _, ref := range spec.Resources.Claims {
		name, err := podClaimName(pod, ref.Name)
		if err != nil {
			return agentapi.Assignment{}, refuse(c, "%v", err)
		}
		if name == "" {
			continue // the pod needs no claim of this entry
		}
		cl, ok := r.claims.Claim(pod.Namespace, name, c.UID)
		if !ok {
			continue // another driver's claim
		}
		switch {
		case !cl.ReservedFor(c.UID):
			return agentapi.Assignment{}, refuse(c, "ResourceClaim %s is not reserved for this pod (its status.reservedFor, as prepared)", name)
		case len(cl.Pods) > 1:
			return agentapi.Assignment{}, refuse(c, "ResourceClaim %s is reserved for %d pods; a claim of mgpu shares serves one container (use a ResourceClaimTemplate: one claim per pod)", name, len(cl.Pods))
		}
		if n := claimUsers(pod, ref.Name); n > 1 {
			return agentapi.Assignment{}, refuse(c, "ResourceClaim %s is used by %d containers of the pod; a claim of mgpu shares serves one container", name, n)
		}
		for _, s := range cl.Shares {
			if ref.Request != "" && strings.Split(s.Request, "/")[0] != ref.Request {
				continue
			}
			if slices.ContainsFunc(gpus, func(g agentapi.GPU) bool { return g.Index == s.GPU }) {
				return agentapi.Assignment{}, refuse(c, "its claims hold two shares of GPU %d; a container has one share of each GPU", s.GPU)
			}
			gpus = append(gpus, agentapi.GPU{Index: s.GPU, Core: s.Core, MemoryMiB: s.MemoryMiB, Claim: name})
		}
	}
	if len(gpus) == 0 {
		return agentapi.Assignment{}, refuse(c, "it has an mgpu device and no ResourceClaim of driver %s prepared on this node (the node's %s is %s); request GPUs through a claim of DeviceClass %s",
			dra.DriverName, ModeLabel, SchemeDRA.Mode, dra.DeviceClassName)
	}
	slices.SortFunc(gpus, func(a, b agentapi.GPU) int { return a.Index - b.Index })
	var pol policy.Policy
	for i, g := range gpus {
		p, ok := r.gpuPol[g.Index]
		if !ok {
			return agentapi.Assignment{}, refuse(c, "the compute policy of GPU %d is not known", g.Index)
		}
		if i > 0 && p != pol {
			return agentapi.Assignment{}, refuse(c, "its GPUs run %s and %s; a container runs under one policy (select GPUs of one policy attribute)", pol, p)
		}
		pol = p
	}
	if v, ok := pod.Annotations[PolicyKey]; ok && v != pol.String() {
		return agentapi.Assignment{}, refuse(c, "annotation %s is %q, and its claim's GPU runs %s (select the policy attribute %q in the claim)", PolicyKey, v, pol, v)
	}
	class, err := ClassOf(pod)
	if err != nil {
		return agentapi.Assignment{}, refuse(c, "%v", err)
	}
	return agentapi.Assignment{Container: c, Policy: pol.String(), Class: class, GPUs: gpus}, nil
}

// podClaimName is the ResourceClaim of the pod's claim entry name: its
// resourceClaimName, or for a template the claim the controller made
// (status.resourceClaimStatuses); "" when the status says none is needed.
func podClaimName(pod *corev1.Pod, entry string) (string, error) {
	i := slices.IndexFunc(pod.Spec.ResourceClaims, func(p corev1.PodResourceClaim) bool { return p.Name == entry })
	if i < 0 {
		return "", fmt.Errorf("the pod has no resourceClaims entry %q", entry)
	}
	pc := pod.Spec.ResourceClaims[i]
	if pc.ResourceClaimName != nil {
		return *pc.ResourceClaimName, nil
	}
	for _, st := range pod.Status.ResourceClaimStatuses {
		if st.Name == entry {
			if st.ResourceClaimName == nil {
				return "", nil
			}
			return *st.ResourceClaimName, nil
		}
	}
	return "", fmt.Errorf("the claim of the pod's resourceClaims entry %q is not made yet (status.resourceClaimStatuses)", entry)
}

// claimUsers is how many of the pod's containers (init containers
// included) name claim entry.
func claimUsers(pod *corev1.Pod, entry string) int {
	n := 0
	for _, l := range [][]corev1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range l {
			if slices.ContainsFunc(l[i].Resources.Claims, func(r corev1.ResourceClaim) bool { return r.Name == entry }) {
				n++
			}
		}
	}
	return n
}
