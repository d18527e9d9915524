package admission

import (
	"fmt"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"

	"github.com/mgpu-dev/mgpu/internal/policy"
)

// PatchOperation is one operation of a JSON Patch (RFC 6902).
type PatchOperation struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// Requirement is the node selector requirement of a pod of policy p: nodes
// whose PolicyKey label is p.
func Requirement(p policy.Policy) corev1.NodeSelectorRequirement {
	return corev1.NodeSelectorRequirement{Key: PolicyKey, Operator: corev1.NodeSelectorOpIn, Values: []string{p.String()}}
}

// patch returns the operations that give pod the annotation of policy p
// and a required node affinity to nodes of that policy.
//
// Required node selector terms are ORed, so the requirement is added to
// every term (the expressions of a term are ANDed), not as a term of its
// own, which would let the pod onto any node that another term allows. A
// term with neither expressions nor fields matches no node and stays
// so. A term that already has the requirement is left alone, and a pod
// that already has the annotation and the requirement everywhere gets no
// operation.
func patch(pod *corev1.Pod, p policy.Policy) []PatchOperation {
	ops := annotationOps(pod, p)

	req := Requirement(p)
	term := corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{req}}
	const (
		affinity = "/spec/affinity"
		node     = affinity + "/nodeAffinity"
		required = node + "/requiredDuringSchedulingIgnoredDuringExecution"
		terms    = required + "/nodeSelectorTerms"
	)
	a := pod.Spec.Affinity
	switch {
	case a == nil:
		return append(ops, PatchOperation{Op: "add", Path: affinity, Value: corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
			RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{term}},
		}}})
	case a.NodeAffinity == nil:
		return append(ops, PatchOperation{Op: "add", Path: node, Value: corev1.NodeAffinity{
			RequiredDuringSchedulingIgnoredDuringExecution: &corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{term}},
		}})
	case a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution == nil:
		return append(ops, PatchOperation{Op: "add", Path: required, Value: corev1.NodeSelector{NodeSelectorTerms: []corev1.NodeSelectorTerm{term}}})
	case len(a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms) == 0:
		// No term matches no node (and the API server refuses it): the
		// requirement becomes the one term.
		return append(ops, PatchOperation{Op: "add", Path: terms, Value: []corev1.NodeSelectorTerm{term}})
	}
	for i, t := range a.NodeAffinity.RequiredDuringSchedulingIgnoredDuringExecution.NodeSelectorTerms {
		switch {
		case len(t.MatchExpressions) == 0 && len(t.MatchFields) == 0:
			// An empty term matches no node; with the requirement it
			// would match every node of the policy.
		case len(t.MatchExpressions) == 0:
			ops = append(ops, PatchOperation{Op: "add", Path: fmt.Sprintf("%s/%d/matchExpressions", terms, i), Value: []corev1.NodeSelectorRequirement{req}})
		case !slices.ContainsFunc(t.MatchExpressions, func(e corev1.NodeSelectorRequirement) bool { return sameRequirement(e, req) }):
			ops = append(ops, PatchOperation{Op: "add", Path: fmt.Sprintf("%s/%d/matchExpressions/-", terms, i), Value: req})
		}
	}
	return ops
}

// annotationOps set the pod's policy annotation to p (none when it is).
func annotationOps(pod *corev1.Pod, p policy.Policy) []PatchOperation {
	switch {
	case len(pod.Annotations) == 0:
		return []PatchOperation{{Op: "add", Path: "/metadata/annotations", Value: map[string]string{PolicyKey: p.String()}}}
	case pod.Annotations[PolicyKey] != p.String():
		return []PatchOperation{{Op: "add", Path: "/metadata/annotations/" + escape(PolicyKey), Value: p.String()}}
	}
	return nil
}

// sameRequirement reports whether a and b select the same nodes by the
// same means.
func sameRequirement(a, b corev1.NodeSelectorRequirement) bool {
	return a.Key == b.Key && a.Operator == b.Operator && slices.Equal(a.Values, b.Values)
}

// escape escapes a key for a JSON Pointer (RFC 6901): "~" is "~0", "/" is
// "~1".
func escape(key string) string {
	return strings.NewReplacer("~", "~0", "/", "~1").Replace(key)
}
