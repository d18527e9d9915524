package chart_test

import (
	"bytes"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/internal/device"
	"github.com/mgpu-dev/mgpu/kube/admission"
	"github.com/mgpu-dev/mgpu/kube/allocview"
	"github.com/mgpu-dev/mgpu/kube/deviceplugin"
)

// TestChartMatchesCode checks the chart against the code that runs in it,
// in both modes: the agent's ClusterRole allows every call the agent
// makes, the admission policy lets through exactly what the agent patches
// (Publish), the webhook configuration is the one the webhook's code
// describes (admission.WebhookConfiguration), and the commands of the agent
// and the webhook parse with the binaries' own flag sets. (These checks
// read packaging/kubernetes/*.yaml before the chart replaced them.)
func TestChartMatchesCode(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{"image", "package"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			m := render(t, "--set", "mode="+mode)
			checkAgentCode(t, m)
			checkWebhookCode(t, m)
		})
	}
}

func checkAgentCode(t *testing.T, m manifest) {
	t.Helper()
	role := must[*rbacv1.ClusterRole](t, m, nodeName)
	can := func(resource, verb string) bool {
		for _, r := range role.Rules {
			if slices.Equal(r.APIGroups, []string{""}) && slices.Contains(r.Resources, resource) && slices.Contains(r.Verbs, verb) {
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
	ds := must[*appsv1.DaemonSet](t, m, nodeName)
	sa := ds.Spec.Template.Spec.ServiceAccountName
	checkNodePolicy(t, sa, must[*admissionregistrationv1.ValidatingAdmissionPolicy](t, m, nodeName),
		must[*admissionregistrationv1.ValidatingAdmissionPolicyBinding](t, m, nodeName))

	agent := container(t, ds.Spec.Template.Spec.Containers, "agent")
	var stderr bytes.Buffer
	if got := deviceplugin.Command(append(slices.Clone(agent.Command[1:]), "--help"), &stderr, &stderr); got != 0 {
		t.Errorf("the agent's command %q: %s", agent.Command, stderr.String())
	}
}

// checkNodePolicy: the ValidatingAdmissionPolicy that scopes the agent's
// node patches to its own Node applies to the agent's service account, to
// every write the ClusterRole allows on nodes, denies, and lets through
// exactly the labels, annotation and capacity the agent patches (Publish).
// What its expressions decide is checked by test/k8s on the real cluster;
// here, that they name the right things.
func checkNodePolicy(t *testing.T, sa string, p *admissionregistrationv1.ValidatingAdmissionPolicy, b *admissionregistrationv1.ValidatingAdmissionPolicyBinding) {
	t.Helper()
	if b.Spec.PolicyName != p.Name || !slices.Equal(b.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) {
		t.Errorf("binding %+v does not deny by policy %s", b.Spec, p.Name)
	}
	var resources []string
	for _, r := range p.Spec.MatchConstraints.ResourceRules {
		if slices.Equal(r.APIGroups, []string{""}) && slices.Contains(r.Operations, admissionregistrationv1.Update) {
			resources = append(resources, r.Resources...)
		}
	}
	if !slices.Contains(resources, "nodes") || !slices.Contains(resources, "nodes/status") {
		t.Errorf("the policy does not match updates of nodes and nodes/status: %v", resources)
	}
	user := `request.userInfo.username == "system:serviceaccount:` + namespace + ":" + sa + `"`
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
	for _, s := range deviceplugin.Schemes {
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

// checkWebhookCode: the MutatingWebhookConfiguration is the code's for the
// chart's Service, with the release namespace excluded beside the code's,
// and the webhook's command parses with its flag set.
func checkWebhookCode(t *testing.T, m manifest) {
	t.Helper()
	got := must[*admissionregistrationv1.MutatingWebhookConfiguration](t, m, admission.ConfigurationName)
	if len(got.Webhooks) != 1 {
		t.Fatalf("%d webhooks, want 1", len(got.Webhooks))
	}
	want := admission.WebhookConfiguration(admission.ConfigurationName,
		admission.ServiceClient(namespace, webhookName, got.Webhooks[0].ClientConfig.CABundle))
	want.Labels = got.Labels
	sel := want.Webhooks[0].NamespaceSelector
	if sel == nil || len(sel.MatchExpressions) != 1 {
		t.Fatalf("the code's namespace selector changed: %+v", sel)
	}
	sel.MatchExpressions[0].Values = append(sel.MatchExpressions[0].Values, namespace)
	if !reflect.DeepEqual(got, want) {
		g, _ := yaml.Marshal(got)
		w, _ := yaml.Marshal(want)
		t.Errorf("the chart's webhook configuration\n%s\nthe code's\n%s", g, w)
	}
	dep := must[*appsv1.Deployment](t, m, webhookName)
	c := container(t, dep.Spec.Template.Spec.Containers, "webhook")
	var stderr bytes.Buffer
	if got := admission.Command(append(slices.Clone(c.Command[1:]), "--help"), &stderr, &stderr); got != 0 ||
		!strings.HasSuffix(c.Command[0], "mgpu-webhook") {
		t.Errorf("the webhook's command %q: %s", c.Command, stderr.String())
	}
}
