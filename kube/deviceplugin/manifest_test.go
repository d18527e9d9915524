package deviceplugin

import (
	"bytes"
	"maps"
	"os"
	"regexp"
	"slices"
	"testing"

	admissionv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/kube/allocview"
)

// TestNodeAgentManifest decodes packaging/kubernetes/node-agent.yaml into
// the typed objects, strictly, and checks what the agent relies on.
func TestNodeAgentManifest(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("../../packaging/kubernetes/node-agent.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var (
		ds      appsv1.DaemonSet
		role    rbacv1.ClusterRole
		sa      corev1.ServiceAccount
		policy  admissionv1.ValidatingAdmissionPolicy
		binding admissionv1.ValidatingAdmissionPolicyBinding
		kinds   []string
	)
	for _, doc := range bytes.Split(data, []byte("\n---\n")) {
		var meta struct{ Kind string }
		if err := yaml.Unmarshal(doc, &meta); err != nil {
			t.Fatal(err)
		}
		kinds = append(kinds, meta.Kind)
		var obj any
		switch meta.Kind {
		case "DaemonSet":
			obj = &ds
		case "ClusterRole":
			obj = &role
		case "ServiceAccount":
			obj = &sa
		case "ClusterRoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		case "ValidatingAdmissionPolicy":
			obj = &policy
		case "ValidatingAdmissionPolicyBinding":
			obj = &binding
		default:
			t.Fatalf("unexpected kind %q", meta.Kind)
		}
		if err := yaml.UnmarshalStrict(doc, obj); err != nil {
			t.Fatalf("%s: %v", meta.Kind, err)
		}
	}
	if !slices.Equal(kinds, []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "DaemonSet"}) {
		t.Fatalf("kinds %v", kinds)
	}
	can := func(resource, verb string) bool {
		for _, r := range role.Rules {
			if slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb) {
				return true
			}
		}
		return false
	}
	for _, rv := range [][2]string{{"pods", "get"}, {"pods", "list"}, {"nodes", "get"}, {"nodes", "patch"}, {"nodes/status", "patch"}} {
		if !can(rv[0], rv[1]) {
			t.Errorf("the ClusterRole cannot %s %s", rv[1], rv[0])
		}
	}
	checkNodePolicy(t, sa, policy, binding)
	c := ds.Spec.Template.Spec.Containers[0]
	mounts := map[string]bool{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = true
	}
	for _, p := range []string{DefaultDir[:len(DefaultDir)-1], "/var/lib/kubelet/pod-resources", "/run/mgpu", "/etc/mgpu"} {
		if !mounts[p] {
			t.Errorf("the DaemonSet does not mount %s", p)
		}
	}
	if len(c.Env) == 0 || c.Env[0].Name != "NODE_NAME" || c.Env[0].ValueFrom == nil || c.Env[0].ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("NODE_NAME is not the pod's node: %+v", c.Env)
	}
}

// checkNodePolicy: the ValidatingAdmissionPolicy that scopes the agent's
// node patches to its own Node applies to the manifest's service account,
// to every write the ClusterRole allows on nodes, denies, and lets through
// exactly the labels, annotation and capacity the agent patches (Publish).
// What its expressions decide is checked against an evaluator outside the
// tests (docs/kubernetes.md); here, that they name the right things.
func checkNodePolicy(t *testing.T, sa corev1.ServiceAccount, p admissionv1.ValidatingAdmissionPolicy, b admissionv1.ValidatingAdmissionPolicyBinding) {
	t.Helper()
	if b.Spec.PolicyName != p.Name || !slices.Equal(b.Spec.ValidationActions, []admissionv1.ValidationAction{admissionv1.Deny}) {
		t.Errorf("binding %+v does not deny by policy %s", b.Spec, p.Name)
	}
	if p.Spec.FailurePolicy == nil || *p.Spec.FailurePolicy != admissionv1.Fail {
		t.Error("the policy does not fail closed")
	}
	var resources []string
	for _, r := range p.Spec.MatchConstraints.ResourceRules {
		if slices.Equal(r.APIGroups, []string{""}) && slices.Contains(r.Operations, admissionv1.Update) {
			resources = append(resources, r.Resources...)
		}
	}
	if !slices.Contains(resources, "nodes") || !slices.Contains(resources, "nodes/status") {
		t.Errorf("the policy does not match updates of nodes and nodes/status: %v", resources)
	}
	user := `request.userInfo.username == "system:serviceaccount:` + sa.Namespace + ":" + sa.Name + `"`
	if len(p.Spec.MatchConditions) != 1 || p.Spec.MatchConditions[0].Expression != user {
		t.Errorf("match conditions %+v, want %s", p.Spec.MatchConditions, user)
	}
	vars := map[string]string{}
	for _, v := range p.Spec.Variables {
		vars[v.Name] = v.Expression
	}
	if vars["tokenNode"] != "request.userInfo.extra[?'authentication.kubernetes.io/node-name'][0].orValue('')" {
		t.Errorf("tokenNode is %q", vars["tokenNode"])
	}
	quoted := regexp.MustCompile(`'([^']*)'`)
	owned := func(name string) []string {
		var out []string
		for _, m := range quoted.FindAllStringSubmatch(vars[name], -1) {
			out = append(out, m[1])
		}
		slices.Sort(out)
		return out
	}
	labels := map[string]bool{device.LabelSchedule: true}
	nl, _, err := device.NodeLabels(config.Default(), []device.Info{{Name: "NVIDIA H100", MemoryBytes: 80 << 30}})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range nl {
		labels[l.Key] = true
	}
	var capacity []string
	for _, s := range Schemes {
		if s.Memory != "" && !s.MemoryIDs { // as Publish patches them
			capacity = append(capacity, string(s.Memory))
		}
	}
	slices.Sort(capacity)
	capacity = slices.Compact(capacity)
	for _, c := range []struct {
		name string
		want []string
	}{
		{"ownedLabels", slices.Sorted(maps.Keys(labels))},
		{"ownedAnnotations", []string{allocview.Annotation}},
		{"ownedCapacity", capacity},
	} {
		if got := owned(c.name); !slices.Equal(got, c.want) {
			t.Errorf("the policy's %s are %q, the agent patches %q", c.name, got, c.want)
		}
	}
	names := map[string]bool{}
	for _, v := range p.Spec.Validations {
		for _, name := range []string{"tokenNode", "ownedLabels", "ownedAnnotations", "ownedCapacity"} {
			if regexp.MustCompile(`variables\.` + name + `\b`).MatchString(v.Expression) {
				names[name] = true
			}
		}
	}
	if len(names) != 4 {
		t.Errorf("the validations use only %v of the variables", slices.Sorted(maps.Keys(names)))
	}
}
