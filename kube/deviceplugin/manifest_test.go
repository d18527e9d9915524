package deviceplugin

import (
	"bytes"
	"os"
	"slices"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"
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
		ds    appsv1.DaemonSet
		role  rbacv1.ClusterRole
		kinds []string
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
			obj = &corev1.ServiceAccount{}
		case "ClusterRoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		default:
			t.Fatalf("unexpected kind %q", meta.Kind)
		}
		if err := yaml.UnmarshalStrict(doc, obj); err != nil {
			t.Fatalf("%s: %v", meta.Kind, err)
		}
	}
	if !slices.Equal(kinds, []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"}) {
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
