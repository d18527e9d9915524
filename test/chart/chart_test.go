// Package chart_test checks the Helm chart charts/mgpu without a cluster:
// helm lint, and helm template for the value sets a user picks, every
// rendered object decoded strictly into its Kubernetes type (ServiceMonitor
// and cert-manager objects into unstructured ones), and the behaviour the
// user relies on checked on those objects: what the node pods run in each
// mode, the webhook's certificate against its caBundle, which optional
// objects exist. The tests need helm (scripts/deps.sh installs it into
// /var/cache/mgpu/bin) and skip without it.
package chart_test

import (
	"bufio"
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	k8sjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/yaml"

	"github.com/mgpu-dev/mgpu/internal/config"
	"github.com/mgpu-dev/mgpu/kube/dra"
)

const (
	chartDir  = "../../charts/mgpu"
	release   = "mgpu"
	namespace = "mgpu-system"
	// kubeVersion is the cluster version helm template and lint assume:
	// the test cluster's (test/k8s).
	kubeVersion = "1.37.2"

	nodeName    = "mgpu-node"
	webhookName = "mgpu-webhook"
	metricsName = "mgpu-metrics"
	// serviceMonitorAPI is what helm's --api-versions says for a cluster
	// with the Prometheus Operator.
	serviceMonitorAPI = "monitoring.coreos.com/v1/ServiceMonitor"
)

// helm returns the helm binary, or skips the test.
func helm(t *testing.T) string {
	t.Helper()
	cache := os.Getenv("CACHE_DIR")
	if cache == "" {
		cache = "/var/cache/mgpu"
	}
	if p := filepath.Join(cache, "bin", "helm"); isExecutable(p) {
		return p
	}
	if p, err := exec.LookPath("helm"); err == nil {
		return p
	}
	t.Skip("helm is not installed (make deps installs it)")
	return ""
}

func isExecutable(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// runHelm runs helm with its own configuration, cache and data directories
// (nothing read from or written to $HOME) and returns its combined output.
func runHelm(t *testing.T, args ...string) (string, error) {
	t.Helper()
	home := t.TempDir()
	cmd := exec.Command(helm(t), args...)
	cmd.Env = append(os.Environ(),
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"),
		"KUBECONFIG="+filepath.Join(home, "no-kubeconfig"),
	)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	err := cmd.Run()
	return out.String(), err
}

// template runs helm template with the release and namespace of the tests
// and the extra arguments.
func template(t *testing.T, args ...string) (string, error) {
	t.Helper()
	return runHelm(t, append([]string{"template", release, chartDir,
		"--namespace", namespace, "--kube-version", kubeVersion}, args...)...)
}

// manifest is what helm template rendered: each object decoded into its
// Kubernetes type, or into an unstructured object for kinds client-go does
// not know (ServiceMonitor, cert-manager's).
type manifest struct {
	typed   []runtime.Object
	untyped []*unstructured.Unstructured
}

// strict decodes YAML into client-go's types, refusing unknown and
// duplicate fields.
var strict = k8sjson.NewSerializerWithOptions(k8sjson.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
	k8sjson.SerializerOptions{Yaml: true, Strict: true})

// untypedGroups are the API groups the chart may render that client-go has
// no types for.
var untypedGroups = []string{"monitoring.coreos.com", "cert-manager.io"}

// render runs helm template and decodes every object it renders; rendering
// and decoding must succeed.
func render(t *testing.T, args ...string) manifest {
	t.Helper()
	out, err := template(t, args...)
	if err != nil {
		t.Fatalf("helm template %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	m, err := decode(out)
	if err != nil {
		t.Fatalf("helm template %s: %v", strings.Join(args, " "), err)
	}
	return m
}

// decode splits helm template's output into documents and decodes each:
// kinds client-go knows strictly into their types, those of untypedGroups
// into unstructured objects; any other kind is an error.
func decode(out string) (manifest, error) {
	var m manifest
	r := utilyaml.NewYAMLReader(bufio.NewReader(strings.NewReader(out)))
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return m, nil
		}
		if err != nil {
			return m, err
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &tm); err != nil {
			return m, fmt.Errorf("%w in\n%s", err, doc)
		}
		if tm.Kind == "" && tm.APIVersion == "" {
			if strings.TrimSpace(stripComments(string(doc))) != "" {
				return m, fmt.Errorf("a document without apiVersion and kind:\n%s", doc)
			}
			continue // only comments: a template that rendered nothing
		}
		gvk := schema.FromAPIVersionAndKind(tm.APIVersion, tm.Kind)
		if scheme.Scheme.Recognizes(gvk) {
			obj, _, err := strict.Decode(doc, nil, nil)
			if err != nil {
				return m, fmt.Errorf("%s %s: %w\n%s", tm.APIVersion, tm.Kind, err, doc)
			}
			m.typed = append(m.typed, obj)
			continue
		}
		if !slices.Contains(untypedGroups, gvk.Group) {
			return m, fmt.Errorf("%s %s is not a kind the chart should render", tm.APIVersion, tm.Kind)
		}
		u := &unstructured.Unstructured{}
		if err := yaml.UnmarshalStrict(doc, &u.Object); err != nil {
			return m, fmt.Errorf("%s %s: %w", tm.APIVersion, tm.Kind, err)
		}
		m.untyped = append(m.untyped, u)
	}
}

func stripComments(s string) string {
	var b strings.Builder
	for l := range strings.Lines(s) {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l)
		}
	}
	return b.String()
}

// must returns the rendered object of type T with the name, and fails the
// test when there is none.
func must[T interface {
	runtime.Object
	metav1.Object
}](t *testing.T, m manifest, name string) T {
	t.Helper()
	for _, o := range m.typed {
		if v, ok := o.(T); ok && v.GetName() == name {
			return v
		}
	}
	var zero T
	t.Fatalf("no %T named %q rendered; have %s", zero, name, m.names())
	return zero
}

// untypedOf returns the unstructured objects of the kind.
func (m manifest) untypedOf(apiVersion, kind string) []*unstructured.Unstructured {
	var us []*unstructured.Unstructured
	for _, u := range m.untyped {
		if u.GetAPIVersion() == apiVersion && u.GetKind() == kind {
			us = append(us, u)
		}
	}
	return us
}

func (m manifest) names() string {
	var s []string
	for _, o := range m.typed {
		a, _ := o.(metav1.Object)
		s = append(s, fmt.Sprintf("%s/%s", o.GetObjectKind().GroupVersionKind().Kind, a.GetName()))
	}
	for _, u := range m.untyped {
		s = append(s, u.GetKind()+"/"+u.GetName())
	}
	return strings.Join(s, ", ")
}

// has says whether an object of the kind and name was rendered.
func (m manifest) has(kind, name string) bool {
	for _, o := range m.typed {
		if a, ok := o.(metav1.Object); ok && o.GetObjectKind().GroupVersionKind().Kind == kind && a.GetName() == name {
			return true
		}
	}
	for _, u := range m.untyped {
		if u.GetKind() == kind && u.GetName() == name {
			return true
		}
	}
	return false
}

func container(t *testing.T, cs []corev1.Container, name string) corev1.Container {
	t.Helper()
	for _, c := range cs {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %q", name)
	return corev1.Container{}
}

func containerNames(cs []corev1.Container) []string {
	var n []string
	for _, c := range cs {
		n = append(n, c.Name)
	}
	return n
}

func mount(c corev1.Container, path string) (corev1.VolumeMount, bool) {
	for _, m := range c.VolumeMounts {
		if m.MountPath == path {
			return m, true
		}
	}
	return corev1.VolumeMount{}, false
}

func volume(spec corev1.PodSpec, name string) (corev1.Volume, bool) {
	for _, v := range spec.Volumes {
		if v.Name == name {
			return v, true
		}
	}
	return corev1.Volume{}, false
}

// hostPathAt returns the host path mounted at path in the container.
func hostPathAt(t *testing.T, spec corev1.PodSpec, c corev1.Container, path string) *corev1.HostPathVolumeSource {
	t.Helper()
	m, ok := mount(c, path)
	if !ok {
		t.Fatalf("container %s mounts nothing at %s", c.Name, path)
	}
	v, ok := volume(spec, m.Name)
	if !ok || v.HostPath == nil {
		t.Fatalf("container %s: the volume %q at %s is no host path", c.Name, m.Name, path)
	}
	return v.HostPath
}

func env(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

func appVersion(t *testing.T) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(chartDir, "Chart.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var c struct {
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	return c.AppVersion
}

// checkCommon checks what holds for every value set: labels, images,
// volumes behind every mount, selectors that select their pods.
func checkCommon(t *testing.T, m manifest) {
	t.Helper()
	image := "ghcr.io/mgpu-dev/mgpu:" + appVersion(t)
	labels := []string{"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
		"app.kubernetes.io/managed-by", "app.kubernetes.io/component", "helm.sh/chart"}
	check := func(kind, name, ns string, l map[string]string, clusterScoped bool) {
		for _, k := range labels {
			if l[k] == "" {
				t.Errorf("%s %s has no label %s", kind, name, k)
			}
		}
		if l["app.kubernetes.io/instance"] != release {
			t.Errorf("%s %s: instance label %q", kind, name, l["app.kubernetes.io/instance"])
		}
		if !clusterScoped && ns != namespace {
			t.Errorf("%s %s is in namespace %q, not the release's", kind, name, ns)
		}
	}
	for _, o := range m.typed {
		a, _ := o.(metav1.Object)
		kind := fmt.Sprintf("%T", o)
		switch o.(type) {
		case *rbacv1.ClusterRole, *rbacv1.ClusterRoleBinding, *admissionregistrationv1.MutatingWebhookConfiguration,
			*admissionregistrationv1.ValidatingAdmissionPolicy, *admissionregistrationv1.ValidatingAdmissionPolicyBinding, *resourcev1.DeviceClass:
			check(kind, a.GetName(), a.GetNamespace(), a.GetLabels(), true)
		default:
			check(kind, a.GetName(), a.GetNamespace(), a.GetLabels(), false)
		}
		var spec *corev1.PodSpec
		var sel *metav1.LabelSelector
		var podLabels map[string]string
		switch w := o.(type) {
		case *appsv1.DaemonSet:
			spec, sel, podLabels = &w.Spec.Template.Spec, w.Spec.Selector, w.Spec.Template.Labels
		case *appsv1.Deployment:
			spec, sel, podLabels = &w.Spec.Template.Spec, w.Spec.Selector, w.Spec.Template.Labels
		}
		if spec == nil {
			continue
		}
		if !matches(sel.MatchLabels, podLabels) || len(sel.MatchExpressions) > 0 {
			t.Errorf("%s %s: selector %v does not select its pods %v", kind, a.GetName(), sel.MatchLabels, podLabels)
		}
		if spec.ServiceAccountName == "" || !m.has("ServiceAccount", spec.ServiceAccountName) {
			t.Errorf("%s %s: service account %q not rendered", kind, a.GetName(), spec.ServiceAccountName)
		}
		for _, c := range append(slices.Clone(spec.InitContainers), spec.Containers...) {
			if c.Image != image {
				t.Errorf("%s %s: container %s runs %q, want %q", kind, a.GetName(), c.Name, c.Image, image)
			}
			if len(c.Command) == 0 || !strings.HasPrefix(c.Command[0], "/usr/bin/") {
				t.Errorf("%s %s: container %s: command %q does not name a binary of the image (no shell there)", kind, a.GetName(), c.Name, c.Command)
			}
			for _, vm := range c.VolumeMounts {
				if _, ok := volume(*spec, vm.Name); !ok {
					t.Errorf("%s %s: container %s mounts volume %q, which the pod does not have", kind, a.GetName(), c.Name, vm.Name)
				}
			}
		}
	}
	for _, u := range m.untyped {
		check(u.GetKind(), u.GetName(), u.GetNamespace(), u.GetLabels(), false)
	}
}

// matches says whether every selector label is among the labels.
func matches(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

var (
	installCommand = []string{"/usr/bin/mgpu-cli", "--config", "/etc/mgpu-chart/config.toml", "node", "install",
		"--host-root", "/host", "--install-dir", "/opt/mgpu", "--config-out", "/etc/mgpu/config.toml"}
	enforcersCommand = []string{"/usr/bin/mgpu-cli", "--config", "/host/etc/mgpu/config.toml", "node", "enforcers"}
	uninstallCommand = []string{"/usr/bin/mgpu-cli", "--config", "/host/etc/mgpu/config.toml", "node", "uninstall",
		"--host-root", "/host", "--install-dir", "/opt/mgpu", "--config-out", "/etc/mgpu/config.toml", "--unless-daemonset", namespace + "/" + nodeName}
	metricsCommand = []string{"/usr/bin/mgpu-cli", "--config", "/host/etc/mgpu/config.toml", "metrics", "serve",
		"--listen", "0.0.0.0:9407"}
)

// checkImageMode checks the node DaemonSet of image mode with the default
// node values.
func checkImageMode(t *testing.T, m manifest) {
	t.Helper()
	ds := must[*appsv1.DaemonSet](t, m, nodeName)
	spec := ds.Spec.Template.Spec
	if got := containerNames(spec.InitContainers); !slices.Equal(got, []string{"install"}) {
		t.Fatalf("init containers %v, want [install]", got)
	}
	if got := containerNames(spec.Containers); !slices.Equal(got, []string{"enforcers", "agent", "metrics"}) {
		t.Errorf("containers %v, want [enforcers agent metrics]", got)
	}
	if !spec.HostPID {
		t.Error("hostPID is off: the enforcers cannot identify containers' processes")
	}
	if spec.TerminationGracePeriodSeconds == nil || *spec.TerminationGracePeriodSeconds != 60 {
		t.Errorf("terminationGracePeriodSeconds %v, want 60", spec.TerminationGracePeriodSeconds)
	}
	install := spec.InitContainers[0]
	if !slices.Equal(install.Command, installCommand) {
		t.Errorf("install command %q, want %q", install.Command, installCommand)
	}
	enforcers := container(t, spec.Containers, "enforcers")
	if !slices.Equal(enforcers.Command, enforcersCommand) {
		t.Errorf("enforcers command %q, want %q", enforcers.Command, enforcersCommand)
	}
	for _, c := range []corev1.Container{install, enforcers, container(t, spec.Containers, "agent")} {
		if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
			t.Errorf("container %s is not privileged", c.Name)
		}
	}
	// The installer and the enforcers see the host's directories where the
	// installer writes them and where the hook on the host looks.
	for _, c := range []corev1.Container{install, enforcers} {
		for path, host := range map[string]string{
			"/host/opt/mgpu": "/opt/mgpu", "/host/etc/mgpu": "/etc/mgpu", "/host/var/run/cdi": "/var/run/cdi",
			"/run/mgpu": "/run/mgpu", "/var/lib/mgpu": "/var/lib/mgpu",
		} {
			hp := hostPathAt(t, spec, c, path)
			if hp.Path != host || hp.Type == nil || *hp.Type != corev1.HostPathDirectoryOrCreate {
				t.Errorf("container %s: %s is host path %q (%v), want %q DirectoryOrCreate", c.Name, path, hp.Path, hp.Type, host)
			}
		}
		m, ok := mount(c, "/etc/mgpu-chart")
		if v, _ := volume(spec, m.Name); !ok || v.ConfigMap == nil || v.ConfigMap.Name != nodeName {
			t.Errorf("container %s: /etc/mgpu-chart is not the ConfigMap %s", c.Name, nodeName)
		}
	}
	if hp := hostPathAt(t, spec, enforcers, "/dev"); hp.Path != "/dev" {
		t.Errorf("enforcers: /dev is %q", hp.Path)
	}
	agent := container(t, spec.Containers, "agent")
	if agent.Lifecycle == nil || agent.Lifecycle.PreStop == nil || agent.Lifecycle.PreStop.Exec == nil {
		t.Fatal("the agent has no preStop exec hook: helm uninstall would leave the node's files")
	}
	if got := agent.Lifecycle.PreStop.Exec.Command; !slices.Equal(got, uninstallCommand) {
		t.Errorf("preStop %q, want %q", got, uninstallCommand)
	}
	for _, p := range []string{"/host/etc/mgpu", "/host/opt/mgpu", "/host/var/run/cdi", "/run/mgpu"} {
		if mt, _ := mount(agent, p); mt.ReadOnly {
			t.Errorf("agent: %s is read-only; the preStop uninstall removes files there", p)
		}
		hostPathAt(t, spec, agent, p)
	}
	if v, _ := env(agent, "MGPU_CONFIG"); v != "/host/etc/mgpu/config.toml" {
		t.Errorf("agent MGPU_CONFIG %q", v)
	}
	metrics := container(t, spec.Containers, "metrics")
	if !slices.Equal(metrics.Command, metricsCommand) {
		t.Errorf("metrics command %q, want %q", metrics.Command, metricsCommand)
	}
	if len(metrics.Ports) != 1 || metrics.Ports[0].Name != "metrics" || metrics.Ports[0].ContainerPort != 9407 {
		t.Errorf("metrics ports %+v, want metrics 9407", metrics.Ports)
	}
	if hp := hostPathAt(t, spec, metrics, "/run/mgpu"); hp.Path != "/run/mgpu" {
		t.Errorf("metrics: /run/mgpu is %q", hp.Path)
	}

	// The preStop hook may read this DaemonSet and nothing else.
	role := must[*rbacv1.Role](t, m, nodeName)
	want := []rbacv1.PolicyRule{{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"},
		ResourceNames: []string{nodeName}, Verbs: []string{"get"}}}
	if fmt.Sprint(role.Rules) != fmt.Sprint(want) {
		t.Errorf("Role rules %+v, want %+v", role.Rules, want)
	}
	rb := must[*rbacv1.RoleBinding](t, m, nodeName)
	if rb.RoleRef.Name != nodeName || len(rb.Subjects) != 1 || rb.Subjects[0].Name != spec.ServiceAccountName ||
		rb.Subjects[0].Namespace != namespace {
		t.Errorf("RoleBinding %+v does not bind the Role to the node's service account", rb)
	}

	// The metrics Service selects the node pods on their metrics port.
	svc := must[*corev1.Service](t, m, metricsName)
	if !matches(svc.Spec.Selector, ds.Spec.Template.Labels) {
		t.Errorf("metrics Service selector %v does not select the node pods %v", svc.Spec.Selector, ds.Spec.Template.Labels)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Name != "metrics" || svc.Spec.Ports[0].TargetPort.String() != "metrics" {
		t.Errorf("metrics Service ports %+v", svc.Spec.Ports)
	}

	// The node configuration is what mgpu's own strict parser accepts.
	cm := must[*corev1.ConfigMap](t, m, nodeName)
	c, err := config.Parse("config.toml", []byte(cm.Data["config.toml"]))
	if err != nil {
		t.Fatalf("the rendered node config does not parse: %v\n%s", err, cm.Data["config.toml"])
	}
	if c.Backend != "nvml" || c.RunDir != "/run/mgpu" || c.StateDir != "/var/lib/mgpu" || c.CDIKind != "mgpu.io/gpu" ||
		c.CDISpecDir != "/var/run/cdi" || c.Defaults.ComputePolicy.String() != "fixed-share" ||
		c.Defaults.ComputeTimeslice != 100 || c.Defaults.MaxInstances != 16 {
		t.Errorf("node config %+v is not the values' defaults", c)
	}
	if regexp.MustCompile(`(?m)^\s*prefix\s*=`).MatchString(cm.Data["config.toml"]) {
		t.Errorf("the chart's node config sets prefix, which is the installer's:\n%s", cm.Data["config.toml"])
	}
}

// checkNodeCommon checks the node side both modes share: scheduling of the
// node pods and the agent's RBAC and admission policy.
func checkNodeCommon(t *testing.T, m manifest) {
	t.Helper()
	ds := must[*appsv1.DaemonSet](t, m, nodeName)
	spec := ds.Spec.Template.Spec
	if spec.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName %q", spec.PriorityClassName)
	}
	if want := []corev1.Toleration{{Operator: corev1.TolerationOpExists}}; !slices.Equal(spec.Tolerations, want) {
		t.Errorf("tolerations %+v, want %+v", spec.Tolerations, want)
	}
	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil ||
		us.RollingUpdate.MaxUnavailable == nil || us.RollingUpdate.MaxUnavailable.IntValue() != 1 {
		t.Errorf("updateStrategy %+v, want RollingUpdate with maxUnavailable 1", us)
	}
	agent := container(t, spec.Containers, "agent")
	if agent.Command[0] != "/usr/bin/mgpu-device-plugin" {
		t.Errorf("agent runs %q", agent.Command)
	}
	var nodeEnv *corev1.EnvVar
	for i := range agent.Env {
		if agent.Env[i].Name == "NODE_NAME" {
			nodeEnv = &agent.Env[i]
		}
	}
	if nodeEnv == nil || nodeEnv.ValueFrom == nil || nodeEnv.ValueFrom.FieldRef == nil || nodeEnv.ValueFrom.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("agent NODE_NAME is not spec.nodeName: %+v", nodeEnv)
	}
	for _, p := range []string{"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources", "/run/mgpu", "/tmp/nvidia-mps",
		"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins/gpu.mgpu.io"} {
		if hp := hostPathAt(t, spec, agent, p); hp.Path != p {
			t.Errorf("agent: %s is host path %q", p, hp.Path)
		}
	}
	for _, f := range []string{"--placement=binpack", "--default-mode=mgpu", "--device-plugin-dir=/var/lib/kubelet/device-plugins",
		"--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock", "--kubelet-dir=/var/lib/kubelet"} {
		if !slices.Contains(agent.Command, f) {
			t.Errorf("agent command %q lacks %s", agent.Command, f)
		}
	}

	sa := spec.ServiceAccountName
	crb := must[*rbacv1.ClusterRoleBinding](t, m, nodeName)
	if crb.RoleRef.Kind != "ClusterRole" || crb.RoleRef.Name != nodeName || len(crb.Subjects) != 1 ||
		crb.Subjects[0].Name != sa || crb.Subjects[0].Namespace != namespace {
		t.Errorf("ClusterRoleBinding %+v does not bind the node's service account", crb)
	}
	cr := must[*rbacv1.ClusterRole](t, m, nodeName)
	if len(cr.Rules) != 5 {
		t.Errorf("ClusterRole rules %+v, want five: pods, nodes, nodes/status, and the DRA driver's resourceclaims and resourceslices", cr.Rules)
	}
	vap := must[*admissionregistrationv1.ValidatingAdmissionPolicy](t, m, nodeName)
	user := fmt.Sprintf("system:serviceaccount:%s:%s", namespace, sa)
	if len(vap.Spec.MatchConditions) != 1 || vap.Spec.MatchConditions[0].Expression != fmt.Sprintf("request.userInfo.username == %q", user) {
		t.Errorf("the policy does not match the agent's user %s: %+v", user, vap.Spec.MatchConditions)
	}
	if vap.Spec.FailurePolicy == nil || *vap.Spec.FailurePolicy != admissionregistrationv1.Fail {
		t.Error("the policy does not fail closed")
	}
	if len(vap.Spec.Validations) != 6 {
		t.Errorf("the policy has %d validations, node-agent.yaml has 6", len(vap.Spec.Validations))
	}
	vapb := must[*admissionregistrationv1.ValidatingAdmissionPolicyBinding](t, m, nodeName)
	if vapb.Spec.PolicyName != vap.Name || !slices.Equal(vapb.Spec.ValidationActions, []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}) {
		t.Errorf("the policy binding %+v does not deny with the policy", vapb.Spec)
	}
}

// checkWebhook checks the webhook's objects with the default values and
// returns the CA its MutatingWebhookConfiguration trusts (nil with
// cert-manager, which injects it).
func checkWebhook(t *testing.T, m manifest) (caBundle []byte, secretName string) {
	t.Helper()
	dep := must[*appsv1.Deployment](t, m, webhookName)
	if dep.Spec.Replicas == nil || *dep.Spec.Replicas != 2 {
		t.Errorf("webhook replicas %v, want 2", dep.Spec.Replicas)
	}
	spec := dep.Spec.Template.Spec
	aa := spec.Affinity
	if aa == nil || aa.PodAntiAffinity == nil || len(aa.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution) != 1 ||
		aa.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].PodAffinityTerm.TopologyKey != "kubernetes.io/hostname" ||
		!matches(aa.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution[0].PodAffinityTerm.LabelSelector.MatchLabels, dep.Spec.Template.Labels) {
		t.Errorf("the webhook's replicas are not spread across nodes: %+v", aa)
	}
	if sc := spec.SecurityContext; sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.RunAsUser == nil || *sc.RunAsUser != 65532 ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("webhook pod security context %+v is not webhook.yaml's", sc)
	}
	c := container(t, spec.Containers, "webhook")
	if sc := c.SecurityContext; sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Capabilities == nil ||
		!slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) {
		t.Errorf("webhook container security context %+v is not webhook.yaml's", sc)
	}
	if p := c.ReadinessProbe; p == nil || p.HTTPGet == nil || p.HTTPGet.Path != "/healthz" || p.HTTPGet.Scheme != corev1.URISchemeHTTPS {
		t.Errorf("webhook readiness probe %+v", p)
	}
	for _, f := range []string{"--tls-cert-file=/etc/mgpu-webhook/tls/tls.crt", "--tls-key-file=/etc/mgpu-webhook/tls/tls.key", "--listen=:8443"} {
		if !slices.Contains(c.Command, f) {
			t.Errorf("webhook command %q lacks %s", c.Command, f)
		}
	}
	mt, ok := mount(c, "/etc/mgpu-webhook/tls")
	v, _ := volume(spec, mt.Name)
	if !ok || v.Secret == nil {
		t.Fatal("the webhook mounts no Secret at /etc/mgpu-webhook/tls")
	}
	secretName = v.Secret.SecretName

	pdb := must[*policyv1.PodDisruptionBudget](t, m, webhookName)
	if pdb.Spec.MinAvailable == nil || pdb.Spec.MinAvailable.IntValue() != 1 || !matches(pdb.Spec.Selector.MatchLabels, dep.Spec.Template.Labels) {
		t.Errorf("PodDisruptionBudget %+v does not keep one webhook replica", pdb.Spec)
	}
	svc := must[*corev1.Service](t, m, webhookName)
	if !matches(svc.Spec.Selector, dep.Spec.Template.Labels) || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != 443 {
		t.Errorf("webhook Service %+v does not serve the webhook's pods on 443", svc.Spec)
	}
	mwc := must[*admissionregistrationv1.MutatingWebhookConfiguration](t, m, "mgpu-policy")
	if len(mwc.Webhooks) != 1 {
		t.Fatalf("%d webhooks, want 1", len(mwc.Webhooks))
	}
	w := mwc.Webhooks[0]
	if s := w.ClientConfig.Service; s == nil || s.Name != svc.Name || s.Namespace != namespace || s.Path == nil || *s.Path != "/mutate" ||
		s.Port == nil || *s.Port != 443 || w.ClientConfig.URL != nil {
		t.Errorf("the webhook's client config %+v does not name the Service", w.ClientConfig)
	}
	if w.FailurePolicy == nil || *w.FailurePolicy != admissionregistrationv1.Fail {
		t.Error("failurePolicy is not Fail")
	}
	if w.SideEffects == nil || *w.SideEffects != admissionregistrationv1.SideEffectClassNone {
		t.Error("sideEffects is not None")
	}
	if len(w.Rules) != 1 || !slices.Equal(w.Rules[0].Operations, []admissionregistrationv1.OperationType{admissionregistrationv1.Create}) ||
		!slices.Equal(w.Rules[0].Resources, []string{"pods"}) {
		t.Errorf("rules %+v, want pod CREATE", w.Rules)
	}
	sel := w.NamespaceSelector
	if sel == nil || len(sel.MatchExpressions) != 1 || sel.MatchExpressions[0].Key != "kubernetes.io/metadata.name" ||
		sel.MatchExpressions[0].Operator != metav1.LabelSelectorOpNotIn ||
		!slices.Contains(sel.MatchExpressions[0].Values, namespace) || !slices.Contains(sel.MatchExpressions[0].Values, "kube-system") {
		t.Errorf("the webhook does not exclude kube-system and the release namespace: %+v", sel)
	}
	return w.ClientConfig.CABundle, secretName
}

// verifyServing checks that the PEM certificate chain verifies against the
// CA for the webhook Service's name and that the key is its key.
func verifyServing(t *testing.T, caPEM, certPEM, keyPEM []byte) {
	t.Helper()
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(caPEM) {
		t.Fatalf("caBundle is not a PEM certificate: %q", caPEM)
	}
	pair, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		t.Fatalf("tls.crt and tls.key: %v", err)
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	dns := webhookName + "." + namespace + ".svc"
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: dns, Roots: roots}); err != nil {
		t.Errorf("the Secret's tls.crt does not verify against the caBundle for %s: %v", dns, err)
	}
}

func TestLint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"defaults", nil},
		{"package mode", []string{"--set", "mode=package"}},
		{"engine", []string{"--set", "node.engine.name=containerd"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			out, err := runHelm(t, append([]string{"lint", "--strict", chartDir}, tc.args...)...)
			if err != nil {
				t.Fatalf("helm lint --strict: %v\n%s", err, out)
			}
			if !strings.Contains(out, "0 chart(s) failed") {
				t.Errorf("helm lint --strict:\n%s", out)
			}
		})
	}
}

// TestRender renders the chart for each value set a user picks and checks
// every object and what the user relies on.
func TestRender(t *testing.T) {
	t.Parallel()
	caPEM := testCA(t)
	caBundle := base64.StdEncoding.EncodeToString(caPEM)
	for _, tc := range []struct {
		name  string
		args  []string
		check func(t *testing.T, m manifest)
	}{
		{"defaults", nil, func(t *testing.T, m manifest) {
			checkImageMode(t, m)
			checkNodeCommon(t, m)
			bundle, secretName := checkWebhook(t, m)
			s := must[*corev1.Secret](t, m, secretName)
			if s.Type != corev1.SecretTypeTLS {
				t.Errorf("Secret type %q", s.Type)
			}
			if !bytes.Equal(s.Data["ca.crt"], bundle) {
				t.Error("the Secret's ca.crt is not the caBundle")
			}
			verifyServing(t, bundle, s.Data["tls.crt"], s.Data["tls.key"])
			if len(m.untypedOf("monitoring.coreos.com/v1", "ServiceMonitor")) != 0 {
				t.Error("a ServiceMonitor on a cluster without the API")
			}
			if m.has("ConfigMap", "mgpu-dashboard") {
				t.Error("the dashboard ConfigMap is rendered by default")
			}
			if m.has("DeviceClass", "gpu.mgpu.io") {
				t.Error("a DeviceClass on a cluster without resource.k8s.io/v1")
			}
		}},
		{"DRA", []string{"--api-versions", "resource.k8s.io/v1/DeviceClass"}, func(t *testing.T, m manifest) {
			dc := must[*resourcev1.DeviceClass](t, m, dra.DeviceClassName)
			if len(dc.Spec.Selectors) != 1 || dc.Spec.Selectors[0].CEL == nil || dc.Spec.Selectors[0].CEL.Expression != `device.driver == "`+dra.DriverName+`"` {
				t.Errorf("DeviceClass selectors %+v", dc.Spec.Selectors)
			}
		}},
		{"package mode", []string{"--set", "mode=package"}, func(t *testing.T, m manifest) {
			checkNodeCommon(t, m)
			checkWebhook(t, m)
			ds := must[*appsv1.DaemonSet](t, m, nodeName)
			spec := ds.Spec.Template.Spec
			if len(spec.InitContainers) != 0 {
				t.Errorf("package mode has init containers %v", containerNames(spec.InitContainers))
			}
			if got := containerNames(spec.Containers); !slices.Equal(got, []string{"agent"}) {
				t.Errorf("package mode runs %v, want only the agent", got)
			}
			if spec.HostPID {
				t.Error("package mode shares the host's pids")
			}
			for _, v := range spec.Volumes {
				if v.HostPath != nil && (v.HostPath.Path == "/opt/mgpu" || v.HostPath.Path == "/var/lib/mgpu" || v.HostPath.Path == "/dev") {
					t.Errorf("package mode mounts the host's %s", v.HostPath.Path)
				}
			}
			agent := spec.Containers[0]
			if agent.Lifecycle != nil {
				t.Error("package mode's agent has a lifecycle hook: nothing of the chart's is on the node to remove")
			}
			if v, _ := env(agent, "MGPU_CONFIG"); v != "/etc/mgpu/config.toml" {
				t.Errorf("agent MGPU_CONFIG %q, want the package's /etc/mgpu/config.toml", v)
			}
			mt, _ := mount(agent, "/etc/mgpu")
			if hp := hostPathAt(t, spec, agent, "/etc/mgpu"); hp.Path != "/etc/mgpu" || !mt.ReadOnly {
				t.Errorf("agent: /etc/mgpu is %q, read-only %v", hp.Path, mt.ReadOnly)
			}
			for _, kind := range []string{"ConfigMap", "Role", "RoleBinding"} {
				if m.has(kind, nodeName) {
					t.Errorf("package mode renders %s %s", kind, nodeName)
				}
			}
			if m.has("Service", metricsName) {
				t.Error("package mode renders the metrics Service: the package's unit exports them")
			}
		}},
		{"cert-manager", []string{"--set", "webhook.tls.source=certManager"}, func(t *testing.T, m manifest) {
			bundle, secretName := checkWebhook(t, m)
			if len(bundle) != 0 {
				t.Error("a caBundle with cert-manager, which injects it")
			}
			if m.has("Secret", secretName) {
				t.Error("the chart renders the Secret cert-manager makes")
			}
			mwc := must[*admissionregistrationv1.MutatingWebhookConfiguration](t, m, "mgpu-policy")
			from := mwc.Annotations["cert-manager.io/inject-ca-from"]
			certs := m.untypedOf("cert-manager.io/v1", "Certificate")
			issuers := m.untypedOf("cert-manager.io/v1", "Issuer")
			if len(certs) != 2 || len(issuers) != 2 {
				t.Fatalf("%d Certificates and %d Issuers, want 2 and 2 (a self-signed CA and its issuer)", len(certs), len(issuers))
			}
			var serving, caCert *unstructured.Unstructured
			for _, c := range certs {
				if namespace+"/"+c.GetName() == from {
					serving = c
				} else {
					caCert = c
				}
			}
			if serving == nil {
				t.Fatalf("inject-ca-from %q names no Certificate", from)
			}
			if s, _, _ := unstructured.NestedString(serving.Object, "spec", "secretName"); s != secretName {
				t.Errorf("the Certificate writes %q, the webhook reads %q", s, secretName)
			}
			dns, _, _ := unstructured.NestedStringSlice(serving.Object, "spec", "dnsNames")
			if !slices.Contains(dns, webhookName+"."+namespace+".svc") {
				t.Errorf("the Certificate's dnsNames %v lack the Service's", dns)
			}
			if isCA, _, _ := unstructured.NestedBool(caCert.Object, "spec", "isCA"); !isCA {
				t.Errorf("Certificate %s is no CA", caCert.GetName())
			}
			// The serving certificate's issuer is a CA Issuer of the CA
			// certificate's Secret, whose issuer is self-signed.
			issuer := func(c *unstructured.Unstructured) *unstructured.Unstructured {
				n, _, _ := unstructured.NestedString(c.Object, "spec", "issuerRef", "name")
				k, _, _ := unstructured.NestedString(c.Object, "spec", "issuerRef", "kind")
				for _, i := range issuers {
					if i.GetName() == n && k == "Issuer" {
						return i
					}
				}
				t.Fatalf("Certificate %s: no Issuer %q", c.GetName(), n)
				return nil
			}
			caSecret, _, _ := unstructured.NestedString(caCert.Object, "spec", "secretName")
			if s, _, _ := unstructured.NestedString(issuer(serving).Object, "spec", "ca", "secretName"); s != caSecret || s == "" {
				t.Errorf("the serving certificate's issuer signs with %q, the CA is in %q", s, caSecret)
			}
			if _, ok, _ := unstructured.NestedMap(issuer(caCert).Object, "spec", "selfSigned"); !ok {
				t.Error("the CA's issuer is not self-signed")
			}
		}},
		{"existing secret", []string{"--set", "webhook.tls.source=secret", "--set", "webhook.tls.existingSecret=my-tls",
			"--set", "webhook.tls.caBundle=" + caBundle}, func(t *testing.T, m manifest) {
			bundle, secretName := checkWebhook(t, m)
			if !bytes.Equal(bundle, caPEM) {
				t.Errorf("caBundle %q, want the given CA", bundle)
			}
			if secretName != "my-tls" {
				t.Errorf("the webhook reads Secret %q, want my-tls", secretName)
			}
			if m.has("Secret", "mgpu-webhook-tls") {
				t.Error("the chart renders a Secret of its own")
			}
		}},
		{"metrics disabled", []string{"--set", "node.metrics.enabled=false", "--set", "node.metrics.serviceMonitor.enabled=true",
			"--api-versions", serviceMonitorAPI}, func(t *testing.T, m manifest) {
			ds := must[*appsv1.DaemonSet](t, m, nodeName)
			if got := containerNames(ds.Spec.Template.Spec.Containers); !slices.Equal(got, []string{"enforcers", "agent"}) {
				t.Errorf("containers %v, want [enforcers agent]", got)
			}
			if m.has("Service", metricsName) || m.has("ServiceMonitor", metricsName) {
				t.Error("the metrics Service or ServiceMonitor without the exporter")
			}
		}},
		{"service monitor forced", []string{"--set", "node.metrics.serviceMonitor.enabled=true",
			"--set", "node.metrics.serviceMonitor.labels.release=prometheus"}, func(t *testing.T, m manifest) {
			checkServiceMonitor(t, m)
		}},
		{"service monitor auto with the API", []string{"--api-versions", serviceMonitorAPI}, func(t *testing.T, m manifest) {
			checkServiceMonitor(t, m)
		}},
		{"service monitor off with the API", []string{"--api-versions", serviceMonitorAPI,
			"--set", "node.metrics.serviceMonitor.enabled=false"}, func(t *testing.T, m manifest) {
			if m.has("ServiceMonitor", metricsName) {
				t.Error("a ServiceMonitor with serviceMonitor.enabled false")
			}
			must[*corev1.Service](t, m, metricsName)
		}},
		{"package mode with the API", []string{"--set", "mode=package", "--api-versions", serviceMonitorAPI}, func(t *testing.T, m manifest) {
			if m.has("ServiceMonitor", metricsName) {
				t.Error("a ServiceMonitor in package mode, where the chart runs no exporter")
			}
		}},
		{"dashboard", []string{"--set", "dashboard.enabled=true"}, func(t *testing.T, m manifest) {
			cm := must[*corev1.ConfigMap](t, m, "mgpu-dashboard")
			if cm.Labels["grafana_dashboard"] != "1" {
				t.Errorf("dashboard labels %v lack grafana_dashboard: \"1\"", cm.Labels)
			}
			want, err := os.ReadFile(filepath.Join(chartDir, "files", "mgpu-dashboard.json"))
			if err != nil {
				t.Fatal(err)
			}
			got := cm.Data["mgpu-dashboard.json"]
			if strings.TrimSpace(got) != strings.TrimSpace(string(want)) {
				t.Error("the ConfigMap's dashboard is not files/mgpu-dashboard.json")
			}
			var d struct {
				Title  string            `json:"title"`
				Panels []json.RawMessage `json:"panels"`
			}
			if err := json.Unmarshal([]byte(got), &d); err != nil || d.Title == "" || len(d.Panels) == 0 {
				t.Errorf("the dashboard is not a Grafana dashboard (%v): title %q, %d panels", err, d.Title, len(d.Panels))
			}
		}},
		{"node selector and driver root", []string{"--set", `node.nodeSelector.vke\.node\.gpu\.schedule=mgpu`,
			"--set", "node.driverRoot=/run/nvidia/driver"}, func(t *testing.T, m manifest) {
			ds := must[*appsv1.DaemonSet](t, m, nodeName)
			spec := ds.Spec.Template.Spec
			if want := map[string]string{"vke.node.gpu.schedule": "mgpu"}; fmt.Sprint(spec.NodeSelector) != fmt.Sprint(want) {
				t.Errorf("nodeSelector %v, want %v", spec.NodeSelector, want)
			}
			for _, c := range append(slices.Clone(spec.InitContainers), container(t, spec.Containers, "enforcers"), container(t, spec.Containers, "agent")) {
				hp := hostPathAt(t, spec, c, "/driver-root")
				if mt, _ := mount(c, "/driver-root"); hp.Path != "/run/nvidia/driver" || !mt.ReadOnly {
					t.Errorf("%s: /driver-root is %q, read-only %v", c.Name, hp.Path, mt.ReadOnly)
				}
				ld, _ := env(c, "LD_LIBRARY_PATH")
				dirs := strings.Split(ld, ":")
				if !slices.Contains(dirs, "/driver-root/usr/lib64") || !slices.Contains(dirs, "/driver-root/usr/lib/x86_64-linux-gnu") {
					t.Errorf("%s: LD_LIBRARY_PATH %q does not name the driver root's libraries", c.Name, ld)
				}
			}
			if _, ok := env(container(t, spec.Containers, "metrics"), "LD_LIBRARY_PATH"); ok {
				t.Error("the metrics exporter loads NVML")
			}
		}},
		{"simulated node config", []string{"--set", "node.config.backend=sim",
			"--set-json", `node.config.sim.gpus=[{"memory_mib":81920},{"name":"Sim \"B\"","memory_mib":40960}]`,
			"--set-json", `node.config.sim.topology=[["X","PIX"],["PIX","X"]]`,
			"--set-json", `node.config.devices=[{"index":1,"compute_policy":"native-burst-share","online_offline_switch":1}]`,
			"--set", "node.config.defaults.compute_policy=guaranteed-burst-share",
			"--set", "node.config.backstop.memory_on_violation=log", "--set", "node.config.backstop.interval=500ms",
			"--set", `node.config.extraToml=[metrics]
listen = "127.0.0.1:9500"`}, func(t *testing.T, m manifest) {
			cm := must[*corev1.ConfigMap](t, m, nodeName)
			text := cm.Data["config.toml"]
			c, err := config.Parse("config.toml", []byte(text))
			if err != nil {
				t.Fatalf("the rendered node config does not parse: %v\n%s", err, text)
			}
			if c.Backend != "sim" || len(c.Sim.GPUs) != 2 || c.Sim.GPUs[1].Name != `Sim "B"` || c.Sim.GPUs[1].MemoryMiB != 40960 ||
				len(c.Sim.Topology) != 2 || c.Sim.Topology[0][1] != "PIX" {
				t.Errorf("sim config %+v", c.Sim)
			}
			if c.Device(0).ComputePolicy.String() != "guaranteed-burst-share" || c.Device(1).ComputePolicy.String() != "native-burst-share" ||
				c.Device(1).OnlineOfflineSwitch != 1 {
				t.Errorf("devices %+v / %+v", c.Device(0), c.Device(1))
			}
			if c.Backstop.MemoryOnViolation != "log" || c.Backstop.Interval != 500*time.Millisecond {
				t.Errorf("backstop %+v", c.Backstop)
			}
			if c.Metrics.Listen != "127.0.0.1:9500" {
				t.Errorf("extraToml's [metrics] listen is %q", c.Metrics.Listen)
			}
			// The DaemonSet rolls when the config changes.
			ds := must[*appsv1.DaemonSet](t, m, nodeName)
			if ds.Spec.Template.Annotations["checksum/config"] == "" {
				t.Error("the node pods carry no checksum of the config")
			}
		}},
		{"another install dir and run dir", []string{"--set", "node.installDir=/usr/local/mgpu", "--set", "node.config.run_dir=/run/mgpu2"},
			func(t *testing.T, m manifest) {
				ds := must[*appsv1.DaemonSet](t, m, nodeName)
				spec := ds.Spec.Template.Spec
				install := spec.InitContainers[0]
				if i := slices.Index(install.Command, "--install-dir"); i < 0 || install.Command[i+1] != "/usr/local/mgpu" {
					t.Errorf("install command %q", install.Command)
				}
				if hp := hostPathAt(t, spec, install, "/host/usr/local/mgpu"); hp.Path != "/usr/local/mgpu" {
					t.Errorf("installDir mount %q", hp.Path)
				}
				for _, c := range spec.Containers {
					if hp := hostPathAt(t, spec, c, "/run/mgpu2"); hp.Path != "/run/mgpu2" {
						t.Errorf("%s: run_dir mount %q", c.Name, hp.Path)
					}
				}
			}},
		{"engine containerd 1.7", []string{"--set", "node.engine.name=containerd"}, func(t *testing.T, m manifest) {
			ds := must[*appsv1.DaemonSet](t, m, nodeName)
			spec := ds.Spec.Template.Spec
			install := spec.InitContainers[0]
			want := []string{"--engine", "containerd", "--engine-config", "/etc/containerd/config.toml", "--containerd-version", "1.7",
				"--containerd-drop-in", "/etc/containerd/conf.d/mgpu.toml", "--engine-restart", "systemctl restart containerd",
				"--engine-restart-root", "/host-root"}
			if i := slices.Index(install.Command, "--engine"); i < 0 || !slices.Equal(install.Command[i:], want) {
				t.Errorf("install command %q, want it to end with %q", install.Command, want)
			}
			agent := container(t, spec.Containers, "agent")
			pre := agent.Lifecycle.PreStop.Exec.Command
			if i := slices.Index(pre, "--engine-restart"); i < 0 || !slices.Equal(pre[i:], want[len(want)-4:]) {
				t.Errorf("preStop %q: want the restart flags", pre)
			}
			for _, c := range []corev1.Container{install, agent} {
				for dir, host := range map[string]string{"/etc/containerd": "/etc/containerd", "/etc/containerd/conf.d": "/etc/containerd/conf.d", "/host-root": "/"} {
					if hp := hostPathAt(t, spec, c, dir); hp.Path != host {
						t.Errorf("%s: %s mounted from %q, want %q", c.Name, dir, hp.Path, host)
					}
				}
			}
		}},
		{"engine docker, turned off, restarted by hand", []string{"--set", "node.engine.name=docker", "--set", "node.engine.configure=false",
			"--set", "node.engine.restart=none", "--set", "node.engine.configFile=/srv/docker/daemon.json"}, func(t *testing.T, m manifest) {
			ds := must[*appsv1.DaemonSet](t, m, nodeName)
			spec := ds.Spec.Template.Spec
			install := spec.InitContainers[0]
			for _, f := range []string{"--engine", "--engine-restart"} {
				if slices.Contains(install.Command, f) {
					t.Errorf("install command %q has %s", install.Command, f)
				}
			}
			// Turned off, the installer still reaches the files to put
			// them back.
			if hp := hostPathAt(t, spec, install, "/srv/docker"); hp.Path != "/srv/docker" {
				t.Errorf("daemon.json's directory mounted from %q", hp.Path)
			}
			for _, v := range spec.Volumes {
				if v.Name == "host-root" {
					t.Error("the host's root is mounted without a restart command")
				}
			}
		}},
		{"webhook disabled", []string{"--set", "webhook.enabled=false"}, func(t *testing.T, m manifest) {
			for _, o := range m.typed {
				if a, _ := o.(metav1.Object); a.GetLabels()["app.kubernetes.io/component"] == "webhook" {
					t.Errorf("%T %s rendered with the webhook disabled", o, a.GetName())
				}
			}
			must[*appsv1.DaemonSet](t, m, nodeName)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			m := render(t, tc.args...)
			checkCommon(t, m)
			tc.check(t, m)
		})
	}
}

func checkServiceMonitor(t *testing.T, m manifest) {
	t.Helper()
	sms := m.untypedOf("monitoring.coreos.com/v1", "ServiceMonitor")
	if len(sms) != 1 {
		t.Fatalf("%d ServiceMonitors, want 1", len(sms))
	}
	sm := sms[0]
	svc := must[*corev1.Service](t, m, metricsName)
	sel, _, _ := unstructured.NestedStringMap(sm.Object, "spec", "selector", "matchLabels")
	if !matches(sel, svc.Labels) {
		t.Errorf("the ServiceMonitor selects %v, the metrics Service has %v", sel, svc.Labels)
	}
	eps, _, _ := unstructured.NestedSlice(sm.Object, "spec", "endpoints")
	if len(eps) != 1 {
		t.Fatalf("ServiceMonitor endpoints %v", eps)
	}
	ep, _ := eps[0].(map[string]any)
	if ep["port"] != "metrics" || ep["path"] != "/metrics" || ep["interval"] != "30s" {
		t.Errorf("ServiceMonitor endpoint %v", ep)
	}
	ns, _, _ := unstructured.NestedStringSlice(sm.Object, "spec", "namespaceSelector", "matchNames")
	if !slices.Equal(ns, []string{namespace}) {
		t.Errorf("ServiceMonitor namespaces %v", ns)
	}
}

// TestInvalidValues checks that values the schema or the templates refuse
// fail rendering with a line that names the value.
func TestInvalidValues(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
		// want are the strings the line naming the mistake holds; a
		// schema's error starts with the value's path.
		want []string
	}{
		{"bad mode", []string{"--set", "mode=bogus"}, []string{"/mode", "'image'", "'package'"}},
		{"bad backend", []string{"--set", "node.config.backend=foo"}, []string{"/node/config/backend", "'nvml'", "'sim'"}},
		{"unknown value", []string{"--set", "node.bogus=1"}, []string{"/node", "bogus"}},
		{"unknown engine", []string{"--set", "node.engine.name=crio"}, []string{"/node/engine/name", "'docker'"}},
		{"prefix is the installer's", []string{"--set", "node.config.prefix=/usr"}, []string{"/node/config", "prefix"}},
		{"bad policy", []string{"--set", "node.config.defaults.compute_policy=fair"}, []string{"/node/config/defaults/compute_policy", "fixed-share"}},
		{"bad service monitor switch", []string{"--set-string", "node.metrics.serviceMonitor.enabled=yes"}, []string{"/node/metrics/serviceMonitor/enabled", "auto"}},
		{"too many instances", []string{"--set", "node.config.defaults.max_instances=500"}, []string{"/node/config/defaults/max_instances", "128"}},
		{"secret without secret", []string{"--set", "webhook.tls.source=secret"}, []string{"webhook.tls.existingSecret is required"}},
		{"secret without CA", []string{"--set", "webhook.tls.source=secret", "--set", "webhook.tls.existingSecret=x"},
			[]string{"webhook.tls.caBundle is required"}},
		{"secret with a CA that is none", []string{"--set", "webhook.tls.source=secret", "--set", "webhook.tls.existingSecret=x",
			"--set", "webhook.tls.caBundle=" + base64.StdEncoding.EncodeToString([]byte("hello"))}, []string{"webhook.tls.caBundle must be a PEM CA"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			out, err := template(t, tc.args...)
			if err == nil {
				t.Fatalf("helm template %s rendered", strings.Join(tc.args, " "))
			}
			// The schema's errors are one line per mistake, "- at '/path': ...".
			if n := strings.Count(out, "\n- at '"); strings.HasPrefix(tc.want[0], "/") && n != 1 {
				t.Errorf("helm template %s: %d schema errors, want 1:\n%s", strings.Join(tc.args, " "), n, out)
			}
			for l := range strings.Lines(out) {
				if containsAll(l, tc.want) {
					return
				}
			}
			t.Errorf("helm template %s: no line says all of %q:\n%s", strings.Join(tc.args, " "), tc.want, out)
		})
	}
}

func containsAll(s string, subs []string) bool {
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			return false
		}
	}
	return true
}

// TestDashboardCopy checks that the chart's dashboard is
// packaging/grafana/mgpu-dashboard.json: helm reads only files inside the
// chart, so the chart holds a copy.
func TestDashboardCopy(t *testing.T) {
	t.Parallel()
	want, err := os.ReadFile("../../packaging/grafana/mgpu-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(chartDir, "files", "mgpu-dashboard.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Error("charts/mgpu/files/mgpu-dashboard.json differs from packaging/grafana/mgpu-dashboard.json; " +
			"copy it: cp packaging/grafana/mgpu-dashboard.json charts/mgpu/files/")
	}
}

// TestNotes checks that NOTES.txt renders (helm template does not render
// it; a client-side dry run of helm install does) and says what each mode
// installed.
func TestNotes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		args []string
		want []string
	}{
		{"defaults", nil, []string{"(image mode)", "rollout status daemonset/mgpu-node", "under /opt/mgpu",
			"outside\nkube-system, mgpu-system (failurePolicy Fail)", "Service mgpu-metrics"}},
		{"package mode", []string{"--set", "mode=package", "--set", "webhook.tls.source=certManager", "--set", "dashboard.enabled=true"},
			[]string{"(package mode)", "need the mgpu package", "cert-manager makes its certificate", "ConfigMap mgpu-dashboard"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			out, err := runHelm(t, append([]string{"install", release, chartDir, "--namespace", namespace, "--dry-run=client"}, tc.args...)...)
			if err != nil {
				t.Fatalf("helm install --dry-run=client: %v\n%s", err, out)
			}
			_, notes, ok := strings.Cut(out, "\nNOTES:\n")
			if !ok {
				t.Fatalf("no NOTES in:\n%s", out)
			}
			for _, w := range tc.want {
				if !strings.Contains(notes, w) {
					t.Errorf("NOTES lack %q:\n%s", w, notes)
				}
			}
		})
	}
}

// TestReadmeValues checks that the chart's README has a row for every
// value of values.yaml. Maps of free keys (labels, a node selector) and a
// container's resources are one value each.
func TestReadmeValues(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var values map[string]any
	if err := yaml.Unmarshal(data, &values); err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile(filepath.Join(chartDir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	var leaves []string
	var walk func(path string, v any)
	walk = func(path string, v any) {
		m, ok := v.(map[string]any)
		_, resources := m["requests"]
		free := slices.Contains([]string{"nodeSelector", "labels", "annotations", "podAnnotations", "updateStrategy"}, path[strings.LastIndex(path, ".")+1:])
		if !ok || len(m) == 0 || resources || free {
			leaves = append(leaves, path)
			return
		}
		for k, sub := range m {
			if path != "" {
				k = path + "." + k
			}
			walk(k, sub)
		}
	}
	walk("", values)
	if len(leaves) < 50 {
		t.Fatalf("only %d values found in values.yaml: %v", len(leaves), leaves)
	}
	for _, v := range leaves {
		if !bytes.Contains(readme, []byte("| `"+v+"` |")) {
			t.Errorf("charts/mgpu/README.md has no row for the value %s", v)
		}
	}
}

// testCA makes a CA certificate (PEM) for the secret source.
func testCA(t *testing.T) []byte {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "test-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
}
