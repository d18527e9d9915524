package admission

import (
	"bytes"
	"os"
	"reflect"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"sigs.k8s.io/yaml"
)

const manifest = "../../packaging/kubernetes/webhook.yaml"

// TestManifest decodes packaging/kubernetes/webhook.yaml strictly into the
// typed objects and checks that they fit together: the webhook
// configuration is WebhookConfiguration's, its Service selects the
// Deployment's pods and reaches their port, and the container is given
// the certificate of the Secret.
func TestManifest(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile(manifest)
	if err != nil {
		t.Fatal(err)
	}
	var (
		sa   *corev1.ServiceAccount
		dep  *appsv1.Deployment
		svc  *corev1.Service
		mwc  *admissionregistrationv1.MutatingWebhookConfiguration
		kind []string
	)
	for doc := range bytes.SplitSeq(b, []byte("\n---\n")) {
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(doc, &tm); err != nil {
			t.Fatal(err)
		}
		kind = append(kind, tm.Kind)
		var obj any
		switch tm.APIVersion + " " + tm.Kind {
		case "v1 ServiceAccount":
			sa = &corev1.ServiceAccount{}
			obj = sa
		case "rbac.authorization.k8s.io/v1 ClusterRole":
			obj = &rbacv1.ClusterRole{}
		case "rbac.authorization.k8s.io/v1 ClusterRoleBinding":
			obj = &rbacv1.ClusterRoleBinding{}
		case "apps/v1 Deployment":
			dep = &appsv1.Deployment{}
			obj = dep
		case "v1 Service":
			svc = &corev1.Service{}
			obj = svc
		case "admissionregistration.k8s.io/v1 MutatingWebhookConfiguration":
			mwc = &admissionregistrationv1.MutatingWebhookConfiguration{}
			obj = mwc
		default:
			t.Fatalf("unexpected %s %s", tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict(doc, obj); err != nil {
			t.Fatalf("%s: %v", tm.Kind, err)
		}
	}
	if want := []string{"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "MutatingWebhookConfiguration"}; !slices.Equal(kind, want) {
		t.Fatalf("kinds %v, want %v", kind, want)
	}
	for _, m := range []metav1.ObjectMeta{sa.ObjectMeta, dep.ObjectMeta, svc.ObjectMeta} {
		if m.Namespace != ExcludedNamespace || m.Name != "mgpu-webhook" {
			t.Errorf("%s/%s, want %s/mgpu-webhook", m.Namespace, m.Name, ExcludedNamespace)
		}
	}

	// The configuration is the code's, with the caBundle left to fill in.
	if len(mwc.Webhooks) == 1 && len(mwc.Webhooks[0].ClientConfig.CABundle) == 0 {
		mwc.Webhooks[0].ClientConfig.CABundle = nil
	} else {
		t.Errorf("want one webhook with an empty caBundle: %+v", mwc.Webhooks)
	}
	if want := WebhookConfiguration(ConfigurationName, ServiceClient(svc.Namespace, svc.Name, nil)); !reflect.DeepEqual(mwc, want) {
		got, _ := yaml.Marshal(mwc)
		w, _ := yaml.Marshal(want)
		t.Errorf("configuration\n%s\nwant\n%s", got, w)
	}
	if !strings.Contains(string(b), `caBundle: ""`) {
		t.Error(`the caBundle placeholder the docs' sed replaces is not caBundle: ""`)
	}

	// The Service reaches the pods' HTTPS port on 443.
	pod := dep.Spec.Template
	if dep.Spec.Selector == nil || !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(pod.Labels)) ||
		!labels.SelectorFromSet(dep.Spec.Selector.MatchLabels).Matches(labels.Set(pod.Labels)) {
		t.Errorf("selectors %v and %v do not select the pods %v", svc.Spec.Selector, dep.Spec.Selector, pod.Labels)
	}
	if pod.Spec.ServiceAccountName != sa.Name {
		t.Errorf("service account %q", pod.Spec.ServiceAccountName)
	}
	if len(pod.Spec.Containers) != 1 || len(svc.Spec.Ports) != 1 {
		t.Fatalf("%d containers, %d service ports", len(pod.Spec.Containers), len(svc.Spec.Ports))
	}
	c := pod.Spec.Containers[0]
	port := svc.Spec.Ports[0]
	if port.Port != 443 || len(c.Ports) != 1 || port.TargetPort.String() != c.Ports[0].Name || c.Ports[0].ContainerPort != 8443 {
		t.Errorf("service port %+v, container ports %+v", port, c.Ports)
	}
	if !slices.Contains(c.Command, "--listen=:8443") {
		t.Errorf("command %q does not listen on 8443", c.Command)
	}
	for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != HealthPath || p.HTTPGet.Scheme != corev1.URISchemeHTTPS || p.HTTPGet.Port.String() != c.Ports[0].Name {
			t.Errorf("probe %+v", p)
		}
	}

	// The command's files are the Secret's.
	if len(c.VolumeMounts) != 1 || len(pod.Spec.Volumes) != 1 || pod.Spec.Volumes[0].Secret == nil ||
		c.VolumeMounts[0].Name != pod.Spec.Volumes[0].Name || pod.Spec.Volumes[0].Secret.SecretName != "mgpu-webhook-tls" {
		t.Fatalf("mounts %+v, volumes %+v", c.VolumeMounts, pod.Spec.Volumes)
	}
	dir := c.VolumeMounts[0].MountPath
	if c.Command[0] != "mgpu-webhook" || !slices.Contains(c.Command, "--tls-cert-file="+dir+"/"+CertFile) || !slices.Contains(c.Command, "--tls-key-file="+dir+"/"+KeyFile) {
		t.Errorf("command %q, want the files of %s", c.Command, dir)
	}
	var stderr bytes.Buffer
	if got := Command(append(slices.Clone(c.Command[1:]), "--help"), &stderr, &stderr); got != 0 {
		t.Errorf("the manifest's flags: %s", stderr.String())
	}
}
