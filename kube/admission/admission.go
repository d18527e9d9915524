// Package admission is mgpu's mutating admission webhook for pods. It
// checks a pod's mgpu requests (the container resources
// vke.volcengine.com/mgpu-core and vke.volcengine.com/mgpu-memory and the
// pod annotation vke.volcengine.com/mgpu-compute-policy) and sends a pod
// that asks for mgpu-core to the nodes whose label of the same key names
// its compute policy, with a required node affinity. See
// docs/kubernetes.md.
package admission

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// The keys the webhook reads (DESIGN.md "Requests (compatible keys)").
const (
	// ResourceCore is the extended resource of a container's core, in
	// percent of one GPU: 1..100, or a multiple of 100 for whole GPUs.
	ResourceCore corev1.ResourceName = "vke.volcengine.com/mgpu-core"
	// ResourceMemory is the extended resource of a container's GPU
	// memory, in MiB.
	ResourceMemory corev1.ResourceName = "vke.volcengine.com/mgpu-memory"
	// PolicyKey is both the pod annotation that names the pod's compute
	// policy and the node label that names the policy a node runs.
	PolicyKey = "vke.volcengine.com/mgpu-compute-policy"
)

// DefaultPolicy is the policy of a pod without the PolicyKey annotation.
const DefaultPolicy = policy.FixedShare

// Denial is why a pod is refused: one cause per field, each naming it
// (e.g. "spec.containers[0].resources.limits[vke.volcengine.com/mgpu-core]:
// 0 is not a valid mgpu-core; ...").
type Denial struct {
	Causes []string
}

// Error joins the causes into one line.
func (d *Denial) Error() string { return strings.Join(d.Causes, "; ") }

func (d *Denial) add(format string, a ...any) {
	d.Causes = append(d.Causes, fmt.Sprintf(format, a...))
}

// Admit decides on a pod being created. A pod it refuses gets a *Denial.
// A pod it admits gets the JSON Patch operations that make it what is
// stored (none for a pod that asks for no mgpu-core, or one that already
// has what the patch would add).
//
// The rules: every container and init container's mgpu-core is 1..100 or
// a multiple of 100, its mgpu-memory a whole number of MiB above 0; memory
// comes with core, and a share of a GPU (core under 100) with memory; a
// request equals its limit where both are set. The policy annotation,
// where present, names one of the three policies, even on a pod without
// mgpu resources (the key is mgpu's, and a mistake in it is refused at
// once rather than when the pod first asks for a GPU). A pod that asks for
// mgpu-core gets the annotation set to its effective policy (fixed-share
// without one) and a required node affinity to nodes labelled with it; a
// nodeSelector on the same key that names another policy is refused, as
// such a pod could never be scheduled.
func Admit(pod *corev1.Pod) ([]PatchOperation, error) {
	var d Denial
	pol, err := podPolicy(pod)
	if err != nil {
		d.add("%s: %v", annotationField, err)
	}
	if v, ok := pod.Annotations[ClassKey]; ok {
		if _, cerr := policy.ParseClass(v); cerr != nil {
			d.add("metadata.annotations[%s]: %q is not a priority class; set online or offline (offline runs only on GPU time online pods leave, on GPUs of online_offline_switch 1 or 2)", ClassKey, v)
		}
	}
	wants := validateContainers(pod, &d)
	if wants && err == nil {
		if v, ok := pod.Spec.NodeSelector[PolicyKey]; ok && v != pol.String() {
			d.add("spec.nodeSelector[%s]: %q is not the pod's compute policy %s (%s); set that annotation to %q, or remove the node selector",
				PolicyKey, v, pol, policySource(pod), v)
		}
	}
	if len(d.Causes) > 0 {
		return nil, &d
	}
	if !wants {
		return nil, nil
	}
	return patch(pod, pol), nil
}

const annotationField = "metadata.annotations[" + PolicyKey + "]"

// ClassKey is the pod annotation of the priority class (online, offline;
// hook.AnnotationClass).
const ClassKey = "vke.volcengine.com/mgpu-class"

// podPolicy returns the policy the pod's annotation names, or the default.
func podPolicy(pod *corev1.Pod) (policy.Policy, error) {
	v, ok := pod.Annotations[PolicyKey]
	if !ok {
		return DefaultPolicy, nil
	}
	p, err := policy.Parse(v)
	if err != nil {
		return 0, fmt.Errorf("%q is not a compute policy; set one of %s", v, strings.Join(policy.Names(), ", "))
	}
	return p, nil
}

// policySource says where the pod's policy came from, for messages.
func policySource(pod *corev1.Pod) string {
	if _, ok := pod.Annotations[PolicyKey]; ok {
		return "from " + annotationField
	}
	return "the default without " + annotationField
}
