package admission

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// validateContainers checks the mgpu resources of every container and init
// container, adding a cause to d for each mistake, and reports whether any
// of them asks for mgpu-core.
func validateContainers(pod *corev1.Pod, d *Denial) bool {
	wants := false
	for i, c := range pod.Spec.Containers {
		if validateContainer(fmt.Sprintf("spec.containers[%d]", i), c.Resources, d) {
			wants = true
		}
	}
	for i, c := range pod.Spec.InitContainers {
		if validateContainer(fmt.Sprintf("spec.initContainers[%d]", i), c.Resources, d) {
			wants = true
		}
	}
	return wants
}

// validateContainer checks one container's resources (at path, e.g.
// "spec.containers[0]") and reports whether it asks for mgpu-core.
func validateContainer(path string, r corev1.ResourceRequirements, d *Denial) bool {
	core, coreField, hasCore := lookup(path, r, ResourceCore, d)
	mem, memField, hasMem := lookup(path, r, ResourceMemory, d)
	c, coreOK := int64(0), false
	if hasCore {
		if c, coreOK = coreValue(core); !coreOK {
			d.add("%s: %s is not a valid mgpu-core; set 1 to 100 (a share of one GPU) or a multiple of 100 (whole GPUs)", coreField, core.String())
		}
	}
	if hasMem {
		if msg := memoryProblem(mem); msg != "" {
			d.add("%s: %s is not a valid mgpu-memory; %s", memField, mem.String(), msg)
		}
		if !hasCore {
			d.add("%s: mgpu-memory needs mgpu-core; set %s.resources.limits[%s] too", memField, path, ResourceCore)
		}
	}
	if coreOK && c < 100 && !hasMem {
		d.add("%s.resources.limits[%s]: missing; a share of one GPU (mgpu-core %d) needs mgpu-memory, a whole number of MiB above 0", path, ResourceMemory, c)
	}
	return hasCore
}

// lookup returns a container's value of key and the field it comes from:
// the limit, or the request where there is no limit (Kubernetes takes a
// limit alone for the request too). A request and limit that differ are a
// cause in d; the limit is returned.
func lookup(path string, r corev1.ResourceRequirements, key corev1.ResourceName, d *Denial) (resource.Quantity, string, bool) {
	limit, hasLimit := r.Limits[key]
	req, hasReq := r.Requests[key]
	switch {
	case hasLimit && hasReq && limit.Cmp(req) != 0:
		d.add("%s.resources.requests[%s]: %s is not the limit %s; an mgpu request must equal its limit (or be left out)",
			path, key, req.String(), limit.String())
		return limit, fmt.Sprintf("%s.resources.limits[%s]", path, key), true
	case hasLimit:
		return limit, fmt.Sprintf("%s.resources.limits[%s]", path, key), true
	case hasReq:
		return req, fmt.Sprintf("%s.resources.requests[%s]", path, key), true
	}
	return resource.Quantity{}, "", false
}

// coreValue returns q as a core: a whole number 1..100 or a multiple of
// 100.
func coreValue(q resource.Quantity) (int64, bool) {
	v, ok := q.AsInt64()
	if !ok || v < 1 || (v > 100 && v%100 != 0) {
		return 0, false
	}
	return v, true
}

// memoryProblem says what is wrong with q as a memory quota in MiB, or ""
// when it is a whole number above 0.
func memoryProblem(q resource.Quantity) string {
	v, ok := q.AsInt64()
	switch {
	case ok && v > 0 && q.Format == resource.BinarySI && v%(1<<20) == 0:
		// "1Gi" is a size in bytes: the key is in MiB.
		return fmt.Sprintf("it is a number of MiB, e.g. %d for %s", v>>20, q.String())
	case ok && v > 0 && q.Format != resource.BinarySI:
		return ""
	}
	return "set a whole number of MiB above 0"
}
