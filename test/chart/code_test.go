package chart_test

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
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

// TestHostNetwork renders the values of a cluster whose pods cannot reach
// the kubernetes Service nor be reached by the API server (test/k8s's): the
// API server's address in the agent and the webhook, both on the host
// network, the webhook listening where the API server calls it, with a
// certificate for that address; package mode reads the package's
// configuration from node.configDir.
func TestHostNetwork(t *testing.T) {
	t.Parallel()
	m := render(t, "--set", "mode=package", "--set", "kubernetesAPI.host=127.0.0.1", "--set", "kubernetesAPI.port=6443",
		"--set", "node.hostNetwork=true", "--set", "node.configDir=/srv/mgpu/etc",
		"--set", "webhook.hostNetwork=true", "--set", "webhook.listen=127.0.0.1:18443",
		"--set", "webhook.url=https://127.0.0.1:18443/mutate", "--set", "webhook.tls.ipAddresses={127.0.0.1}")
	apiEnv := func(what string, c corev1.Container) {
		t.Helper()
		host, _ := env(c, "KUBERNETES_SERVICE_HOST")
		port, _ := env(c, "KUBERNETES_SERVICE_PORT")
		if host != "127.0.0.1" || port != "6443" {
			t.Errorf("%s: KUBERNETES_SERVICE_HOST %q, _PORT %q, want 127.0.0.1 and 6443", what, host, port)
		}
	}
	hostNet := func(what string, spec corev1.PodSpec) {
		t.Helper()
		if !spec.HostNetwork || spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
			t.Errorf("%s: hostNetwork %v, dnsPolicy %q", what, spec.HostNetwork, spec.DNSPolicy)
		}
	}
	ds := must[*appsv1.DaemonSet](t, m, nodeName)
	spec := ds.Spec.Template.Spec
	hostNet("node pods", spec)
	agent := container(t, spec.Containers, "agent")
	apiEnv("agent", agent)
	if hp := hostPathAt(t, spec, agent, "/etc/mgpu"); hp.Path != "/srv/mgpu/etc" {
		t.Errorf("agent: /etc/mgpu is host path %q, want node.configDir", hp.Path)
	}

	dep := must[*appsv1.Deployment](t, m, webhookName)
	wspec := dep.Spec.Template.Spec
	hostNet("webhook pods", wspec)
	c := container(t, wspec.Containers, "webhook")
	apiEnv("webhook", c)
	if !slices.Contains(c.Command, "--listen=127.0.0.1:18443") || len(c.Ports) != 1 || c.Ports[0].ContainerPort != 18443 {
		t.Errorf("webhook command %q, ports %+v: want it listening on 127.0.0.1:18443", c.Command, c.Ports)
	}
	mwc := must[*admissionregistrationv1.MutatingWebhookConfiguration](t, m, admission.ConfigurationName)
	cc := mwc.Webhooks[0].ClientConfig
	if cc.Service != nil || cc.URL == nil || *cc.URL != "https://127.0.0.1:18443/mutate" {
		t.Errorf("client config %+v, want only the URL", cc)
	}
	var secret *corev1.Secret
	for _, o := range m.typed {
		if s, ok := o.(*corev1.Secret); ok && s.Type == corev1.SecretTypeTLS {
			secret = s
		}
	}
	if secret == nil {
		t.Fatal("no TLS Secret rendered")
	}
	pair, err := tls.X509KeyPair(secret.Data["tls.crt"], secret.Data["tls.key"])
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(cc.CABundle)
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: roots}); err != nil || leaf.VerifyHostname("127.0.0.1") != nil {
		t.Errorf("the serving certificate (IPs %v) does not verify for 127.0.0.1 against the caBundle: %v", leaf.IPAddresses, err)
	}

	// The defaults leave all of it out.
	m = render(t)
	if spec := must[*appsv1.DaemonSet](t, m, nodeName).Spec.Template.Spec; spec.HostNetwork {
		t.Error("the node pods are on the host network by default")
	}
	for _, c := range must[*appsv1.DaemonSet](t, m, nodeName).Spec.Template.Spec.Containers {
		if _, ok := env(c, "KUBERNETES_SERVICE_HOST"); ok {
			t.Errorf("%s sets KUBERNETES_SERVICE_HOST by default", c.Name)
		}
	}
}

// TestConfigDir: in image mode node.configDir is where the installer
// writes the node configuration (and the uninstaller removes it), and
// where the enforcers and the agent read it.
func TestConfigDir(t *testing.T) {
	t.Parallel()
	m := render(t, "--set", "node.configDir=/srv/mgpu/etc")
	spec := must[*appsv1.DaemonSet](t, m, nodeName).Spec.Template.Spec
	install := container(t, spec.InitContainers, "install")
	agent := container(t, spec.Containers, "agent")
	enforcers := container(t, spec.Containers, "enforcers")
	has := func(what string, cmd []string, args ...string) {
		t.Helper()
		for i := range cmd {
			if slices.Equal(cmd[i:min(i+len(args), len(cmd))], args) {
				return
			}
		}
		t.Errorf("%s %q lacks %q", what, cmd, args)
	}
	has("install", install.Command, "--config-out", "/srv/mgpu/etc/config.toml")
	has("preStop", agent.Lifecycle.PreStop.Exec.Command, "--config-out", "/srv/mgpu/etc/config.toml")
	has("preStop", agent.Lifecycle.PreStop.Exec.Command, "--config", "/host/srv/mgpu/etc/config.toml")
	has("enforcers", enforcers.Command, "--config", "/host/srv/mgpu/etc/config.toml")
	if v, _ := env(agent, "MGPU_CONFIG"); v != "/host/srv/mgpu/etc/config.toml" {
		t.Errorf("agent MGPU_CONFIG %q", v)
	}
	for _, c := range []corev1.Container{install, agent, enforcers} {
		if hp := hostPathAt(t, spec, c, "/host/srv/mgpu/etc"); hp.Path != "/srv/mgpu/etc" {
			t.Errorf("%s: /host/srv/mgpu/etc is host path %q", c.Name, hp.Path)
		}
	}
}
